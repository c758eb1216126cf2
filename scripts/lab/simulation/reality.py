"""What happened in the simulated world, held against what the log says.

``.invariants`` checks that the log is well formed and that every answer agrees
with it. That cannot see a reply lost between the broker and the log: its call then times out,
and a timeout is a legitimate entry. These invariants read the world's own record instead: the
broker's ledger (every message it took, with its fate) and the fault layer's chronicle (every
commit, every publish of a worker that reached the broker, every ack a worker sent, numbered in
the order they happened: ``.faults.Chronicle``). :func:`problems` requires:

1. every reply the broker took ends in the log by its message id, as the claim of its call or as
   an ignored reply (``ReplyIgnored``), whenever it came: before its call's deadline it claims,
   unless a copy of it or another reply claimed first (``duplicate``) or, held up by a crash
   or a slow worker, it found the deadline had claimed (``late``); after the task finished
   (completed, failed, cancelled meanwhile) it is ``late``; a body the log cannot store claims
   with an ``unstorable-reply`` error. The one exception: a reply dead-lettered at the delivery
   limit (by a worker past the crash limit, or by the broker past its own), its workers having
   died holding it, which only crashes and dropped connections make. Conversely, every claim
   and ignored reply in the log names a reply the broker took;
2. every peer request a worker published was published after the pause that makes the call
   committed (G5), and every call of a committed pause was published to its peer's queue (G4);
3. a cancel names exactly the calls still outstanding when it commits (``TaskCancelled.pending``),
   and each of them, each call timed out and each call a ``FirstK`` pause gave up when it
   resumed (``TaskResumed.abandoned``) gets a cancel message (``<subtask>:cancel``) to its
   peer's queue after that commit (G6, G7); no worker sends a cancel nothing committed implies
   (a signal's wait and a timer have no peer: they are never cancelled);
4. an ignored reply says why truly: ``duplicate`` when another reply claimed the call, ``late``
   when its deadline did, the task had finished or its pause had given it up; never
   ``unknown-call``, since every reply in this world answers a call the log already holds (G5);
5. every dead letter's reason is one the scenario can produce for its kind of message
   (:func:`_allowed`), and every call's error is one its peers can give;
6. every delivery a worker acked had its effect recorded before the ack (G1): a reply its claim
   or its ``ReplyIgnored``; a task its stream's events, or (completed without peers: it writes
   nothing, G10) its result published; a resume the outcome of the resumed run; a cancel the
   task's end, and its answer published; or, for any, the copy sent back for a retry, or the
   dead letter published with what it implies (a handler failed for good: its task ended; an
   unstorable reply: its call failed); a signal its record (``SignalReceived``,
   ``SignalRefused``) or its answer to its sender. (A progress report that extends no deadline
   writes nothing, by design: it is not checked.)

Only peer calls have requests, replies and cancels: the waits for signals and timers of a pause
(issue 31) are left out of 1 to 4, and held against what happened by ``.waits``.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from waystation.brokers.memory import StoredMessage
from waystation.brokers.port import Delivery
from waystation.events import RecordedEvent, parse_subtask_id
from waystation.events.codec import loads, unstorable
from waystation.protocol.wire import (
    HEADER_ATTEMPTS,
    HEADER_QUEUE,
    HEADER_REASON,
    TYPE_CANCEL,
    TYPE_PROGRESS,
    TYPE_RESULT,
    TYPE_RESUME,
    TYPE_SIGNAL,
    TYPE_TASK,
    Names,
    derived_id,
)
from waystation.runtime.verdicts import crash_limit

from .faults import Acked, Sent
from .loop import EPOCH
from .scenario import MAX_MESSAGE, TaskSpec
from .world import CANCELS, FULL, GONE, PREFIX, RESULTS, SIGNALS, Observed

__all__ = ["problems"]

_TERMINAL = ("TaskCompleted", "TaskFailed", "TaskCancelled")
_AGENTS = ("orchestrator", "researcher", "oracle")
CALL_ERRORS = frozenset({"oracle", "unstorable-reply", "DeliveryLimitReached"})
"""The error types a call's result can carry here: the plain peer answers an error, or answers
one the log cannot store (the worker records ``unstorable-reply`` instead), or a researcher fails
at the crash limit (its workers kept dying holding the request). A researcher is never cancelled
while its call is outstanding (only claimed calls and finished tasks' calls are), and its handler
never raises on a peer request."""


def problems(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    world = _World(observed, streams)
    return [
        *_replies_end_in_the_log(world),
        *_requests_follow_their_pause(world),
        *_cancels_name_the_outstanding_calls(world),
        *_ignored_replies_say_why(world),
        *_dead_letters_have_a_reason_of_their_kind(world),
        *_acks_follow_their_effect(world),
    ]


# ---- what the world kept, indexed ------------------------------------------------------------


@dataclass
class _Moment:
    """A stream as it stood before one of its events: the little of its fold these checks need,
    folded here from the raw events rather than by ``waystation.events.task`` (whose decisions they
    judge)."""

    status: str = "new"
    calls: dict[str, str] = field(default_factory=dict)
    """The current pause's peer calls, in call order: sub-task to peer."""
    claims: dict[str, str | None] = field(default_factory=dict)
    """Every claimed sub-task to the message id of the reply that claimed it (None: a timeout)."""
    abandoned: set[str] = field(default_factory=set)
    """Every wait a ``FirstK`` pause gave up when it resumed."""

    def outstanding(self) -> list[tuple[str, str]]:
        if self.status != "paused":
            return []
        return [(s, agent) for s, agent in self.calls.items() if s not in self.claims]

    def apply(self, event: RecordedEvent) -> None:
        kind, data = event.event_type, event.data
        if kind == "TaskStarted":
            self.status = "running"
        elif kind == "TaskPaused":
            self.status = "paused"
            self.calls = {
                c["subtask_id"]: c["agent"]
                for c in data["calls"]
                if c.get("kind", "call") == "call"
            }
        elif kind == "SubtaskClaimed":
            self.claims[data["subtask_id"]] = data.get("message_id")
        elif kind == "TaskResumed":
            self.status = "resumed"
            self.abandoned.update(c["subtask_id"] for c in data.get("abandoned", ()))
        elif kind in _TERMINAL:
            self.status = "finished"


def _walk(events: list[RecordedEvent]) -> Iterator[tuple[RecordedEvent, _Moment]]:
    """Each event with the stream as it stood before it (one moment, updated in place)."""
    moment = _Moment()
    for event in events:
        yield event, moment
        moment.apply(event)


class _World:
    def __init__(self, observed: Observed, streams: dict[str, list[RecordedEvent]]) -> None:
        self.observed = observed
        self.streams = streams
        self.scenario = observed.scenario
        self.names = Names(PREFIX)
        self.task_queues = {self.names.tasks(agent) for agent in _AGENTS}
        self.limit = self.scenario.delivery_limit
        self.specs: dict[str, TaskSpec] = {spec.task_id: spec for spec in self.scenario.tasks}
        self.commits = observed.chronicle.commits
        dead = {id(letter) for letter in observed.dead_letters}
        self.dead_letters = observed.dead_letters
        self.taken = [m for m in observed.published if id(m) not in dead]
        """What the broker took into a queue other than the dead-letter queue."""
        self.sent: dict[str, list[Sent]] = defaultdict(list)
        for sent in observed.chronicle.sent:
            self.sent[sent.message.message_id].append(sent)
        self.recorded: dict[tuple[str, str | None], int] = {}
        """(sub-task, message id) of each claim and ignored reply, to when it committed."""
        self.calls: dict[str, tuple[RecordedEvent, str]] = {}
        """Each peer call of a committed pause, to that pause and the call's peer."""
        self.deadlines: dict[str, float] = {}
        self.timed_out: set[str] = set()
        for events in streams.values():
            for event in events:
                data = event.data
                if event.event_type in ("SubtaskClaimed", "ReplyIgnored"):
                    key = (data["subtask_id"], data.get("message_id"))
                    self.recorded.setdefault(key, self.committed(event))
                elif event.event_type == "TaskPaused":
                    for call in data["calls"]:
                        if call.get("kind", "call") == "call":
                            self.calls[call["subtask_id"]] = (event, call["agent"])
                        self.deadlines[call["subtask_id"]] = call["deadline_at"]
                elif event.event_type == "DeadlineExtended":
                    self.deadlines[data["subtask_id"]] = data["deadline_at"]
                elif event.event_type == "ResultRecorded" and data["outcome"] == "timeout":
                    self.timed_out.add(data["subtask_id"])

    def is_reply_queue(self, queue: str) -> bool:
        """Whether ``queue`` is an agent's reply queue: its shared one, or one of its shards."""
        return any(
            queue == replies or queue.startswith(f"{replies}.")
            for replies in (self.names.replies(agent) for agent in _AGENTS)
        )

    def committed(self, event: RecordedEvent) -> int:
        """When ``event`` committed, in the chronicle's order (every append is a worker's)."""
        return self.commits[event.global_position]

    def sent_before(self, message_id: str, seq: int, **where: Any) -> list[Sent]:
        """Publishes of ``message_id`` that reached the broker before ``seq``, with ``where``:
        ``exchange``, ``routing_key``, ``type``."""
        return [s for s in self.sent.get(message_id, ()) if s.seq < seq and _is(s, where)]

    def refused_before(self, message_id: str, seq: int) -> list[Any]:
        """Publishes of ``message_id`` the broker refused before ``seq``."""
        return [
            r
            for r in self.observed.chronicle.refused
            if r.message.message_id == message_id and r.seq < seq
        ]

    def dead_at_the_limit(self, message_id: str | None, queue: str) -> bool:
        """Whether ``message_id`` of ``queue`` was dead-lettered at the delivery limit (by a
        worker, or by the broker itself); :func:`_allowed` checks its count."""
        for letter in self.dead_letters:
            headers = letter.headers
            if letter.properties.get("message_id") != message_id:
                continue
            if headers.get(HEADER_REASON) == "delivery-limit":
                if headers.get(HEADER_QUEUE) == queue:
                    return True
            if (
                headers.get("x-first-death-reason") == "delivery_limit"
                and headers.get("x-first-death-queue") == queue
            ):
                return True
        return False


def _is(sent: Sent, where: dict[str, Any]) -> bool:
    message = sent.message
    for name, value in where.items():
        actual = message.properties.get(name) if name == "type" else getattr(message, name)
        if actual != value:
            return False
    return True


def _kind(message_type: str | None, queue: str, world: _World, message_id: str | None) -> str:
    """What a message is, from its type and the queue it came from: ``task`` (a publisher's),
    ``request`` (a peer request), ``resume``, ``cancel``, ``signal``, ``reply``, ``progress``,
    ``answer`` (to a publisher's queue, a signal's sender's among them) or ``other``."""
    if world.is_reply_queue(queue):
        message_type = message_type or TYPE_RESULT
        return {TYPE_RESULT: "reply", TYPE_PROGRESS: "progress"}.get(message_type, "other")
    if queue in (RESULTS, CANCELS, GONE, SIGNALS) or queue.startswith(FULL):
        return "answer"
    if queue in world.task_queues:
        message_type = message_type or TYPE_TASK
        if message_type == TYPE_TASK:
            return "request" if _subtask(message_id) else "task"
        kinds = {TYPE_RESUME: "resume", TYPE_CANCEL: "cancel", TYPE_SIGNAL: "signal"}
        return kinds.get(message_type, "other")
    return "other"


def _subtask(value: str | None) -> str | None:
    """The task id of a sub-task id (None when ``value`` is not one)."""
    if not value:
        return None
    try:
        task_id, _, _ = parse_subtask_id(value)
    except ValueError:
        return None
    return task_id


def _count(headers: dict[str, Any]) -> int:
    """How many times the broker took a message back unsettled (either count it keeps)."""
    counts = (headers.get("x-delivery-count", 0), headers.get("x-acquired-count", 0))
    return max(c for c in counts if isinstance(c, int))


def _at(message: StoredMessage) -> str:
    return f"+{message.enqueued_at - EPOCH:.1f}s"


# ---- 1. every reply the broker took ends in the log ------------------------------------------


def _replies_end_in_the_log(world: _World) -> list[str]:
    found = []
    replies: set[tuple[str | None, str | None]] = set()
    for message in world.taken:
        if _kind(message.properties.get("type"), message.routing_key, world, None) != "reply":
            continue
        if hostile_tag(message.body) is not None:
            continue  # a hostile publisher's: dead-lettered, checked with the dead letters
        subtask = message.properties.get("correlation_id")
        message_id = message.properties.get("message_id")
        replies.add((subtask, message_id))
        if (subtask, message_id) in world.recorded:
            continue
        if world.dead_at_the_limit(message_id, message.routing_key):
            continue  # its workers kept dying holding it (its count is checked with the reasons)
        deadline = world.deadlines.get(subtask or "")
        when = (
            "before its call's deadline"
            if deadline is not None and message.enqueued_at < deadline
            else "after its call's deadline"
        )
        timed_out = ", and the call timed out" if subtask in world.timed_out else ""
        found.append(
            f"reply {message_id} to {subtask} reached the broker at {_at(message)} "
            f"({when}) and is not in the log (no claim, no ReplyIgnored){timed_out}"
        )
    for subtask, message_id in world.recorded:
        if subtask not in world.calls:
            continue  # a signal's wait, claimed by its signal (``.waits``)
        if message_id is not None and (subtask, message_id) not in replies:
            found.append(f"{subtask}: the log records reply {message_id}, which nobody sent")
    return found


# ---- 2. peer requests follow their pause (G5), and every call is sent (G4) --------------------


def _requests_follow_their_pause(world: _World) -> list[str]:
    found = []
    published: set[str] = set()
    for sent in world.observed.chronicle.sent:
        message = sent.message
        subtask = message.message_id
        if (
            message.properties.get("type") != TYPE_TASK
            or message.properties.get("correlation_id") != subtask
            or _subtask(subtask) is None
        ):
            continue
        made = world.calls.get(subtask)
        if made is None:
            found.append(f"peer request {subtask} was published, and no pause makes that call")
            continue
        pause, agent = made
        if world.committed(pause) > sent.seq:
            found.append(
                f"peer request {subtask} was published before its pause committed (G5), "
                f"by {sent.worker}"
            )
        if message.exchange == "" and message.routing_key == world.names.tasks(agent):
            published.add(subtask)
    for subtask in world.calls:
        if subtask not in published:
            found.append(f"call {subtask} of a committed pause never reached its peer (G4)")
    return found


# ---- 3. a cancel names the outstanding calls, and each one is cancelled (G6, G7) --------------


def _cancels_name_the_outstanding_calls(world: _World) -> list[str]:
    found = []
    causes: dict[str, int] = {}
    """Each sub-task whose cancel a committed event implies, to when that committed."""
    for task_id, events in world.streams.items():
        for event, moment in _walk(events):
            if event.event_type == "TaskCancelled":
                named = [(c["subtask_id"], c["agent"]) for c in event.data.get("pending", ())]
                outstanding = moment.outstanding()
                if named != outstanding:
                    found.append(
                        f"{task_id}: its cancel names {[s for s, _ in named]}, while "
                        f"{[s for s, _ in outstanding]} were outstanding (G7)"
                    )
                for subtask, _ in named:
                    causes.setdefault(subtask, world.committed(event))
            elif event.event_type == "ResultRecorded" and event.data["outcome"] == "timeout":
                if event.data["subtask_id"] in world.calls:
                    causes.setdefault(event.data["subtask_id"], world.committed(event))
            elif event.event_type == "TaskResumed":
                for given_up in event.data.get("abandoned", ()):
                    if given_up["subtask_id"] in world.calls:
                        causes.setdefault(given_up["subtask_id"], world.committed(event))
    for subtask, seq in causes.items():
        agent = world.calls[subtask][1] if subtask in world.calls else None
        cancels = [
            s
            for s in world.sent.get(f"{subtask}:cancel", ())
            if s.seq > seq
            and _is(s, {"exchange": "", "type": TYPE_CANCEL})
            and s.message.routing_key == world.names.tasks(agent or "")
        ]
        if not cancels:
            found.append(f"call {subtask} was cancelled or timed out, and its peer never told")
    for sent in world.observed.chronicle.sent:
        message = sent.message
        if not _is(sent, {"exchange": "", "type": TYPE_CANCEL}):
            continue
        subtask = message.message_id.removesuffix(":cancel")
        if _subtask(subtask) is None:
            continue
        if causes.get(subtask, sent.seq) >= sent.seq:
            found.append(
                f"{sent.worker} sent the cancel of {subtask}, and no committed cancel or "
                "timeout names that call"
            )
    return found


# ---- 4. an ignored reply says why ------------------------------------------------------------


def _ignored_replies_say_why(world: _World) -> list[str]:
    found = []
    for events in world.streams.values():
        for event, moment in _walk(events):
            if event.event_type != "ReplyIgnored":
                continue
            subtask = event.data["subtask_id"]
            message_id = event.data.get("message_id")
            if subtask in moment.claims:
                claimer = moment.claims[subtask]
                expected = "late" if claimer is None else "duplicate"
                if claimer is not None and claimer == message_id:
                    found.append(f"{subtask}: reply {message_id} ignored, and it is the claim")
            elif moment.status == "finished" or subtask in moment.abandoned:
                expected = "late"
            else:
                expected = "a claim"
            reason = event.data["reason"]
            if reason == "unknown-call":
                found.append(
                    f"{subtask}: reply {message_id} recorded for a call the log did not hold "
                    f"(the task {moment.status}): a reply overtook its checkpoint (G5)"
                )
            elif reason != expected:
                found.append(f"{subtask}: reply {message_id} ignored as {reason}, not {expected}")
    return found


# ---- 5. dead letters and call errors have a reason the scenario can produce ------------------


def _dead_letters_have_a_reason_of_their_kind(world: _World) -> list[str]:
    found = []
    for letter in world.dead_letters:
        headers = letter.headers
        queue = headers.get(HEADER_QUEUE) or headers.get("x-first-death-queue") or ""
        message_id = letter.properties.get("message_id")
        kind = _kind(letter.properties.get("type"), queue, world, message_id)
        why = _allowed(world, letter, kind, queue)
        if why is not None:
            found.append(f"dead letter {message_id} ({kind} from {queue}): {why}")
    for events in world.streams.values():
        for event in events:
            if event.event_type == "ResultRecorded" and event.data["outcome"] == "error":
                error = event.data.get("error")
                kind = error.get("type") if isinstance(error, dict) else None
                if kind not in CALL_ERRORS:
                    found.append(f"{event.data['subtask_id']}: no peer here fails as {error}")
    return found


def _allowed(world: _World, letter: StoredMessage, kind: str, queue: str) -> str | None:
    """Why ``letter`` should not be a dead letter of ``kind`` (None: the scenario can make it).

    * at the delivery limit, any kind a worker consumes: by the broker (``delivery_limit``) past
      its limit (one above the crash limit), by a worker (``delivery-limit``: replies, progress
      reports, cancels and signals; ``handler-failed`` with ``DeliveryLimitReached``: tasks,
      requests and resumes) past the crash limit, when its workers died (or lost their
      connection) holding it;
    * ``handler-failed``: a task or resume whose handler raises (``fails``: every run of a
      researcher's, and an orchestrator's when handler faults are on) or returns an outcome no
      log can store (``bad``); a peer request never (its input asks for neither);
    * ``unroutable`` never: an answer to a publisher that is gone is counted as undelivered
      (``results_undelivered``), not dead-lettered;
    * ``refused``: an answer to a publisher's queue that stayed full longer than the workers try,
      or a signal's answer the broker nacked each time a worker tried it in place (``refuse``);
    * ``unstorable``: a reply whose body the log cannot store (the plain peer's errors with a
      NUL; its call fails at once, recorded before the ack: :func:`_missing_effect`);
    * nothing else: no input here is malformed, oversized, or for an unknown task (a reply to
      a call Waystation made always finds its task: G5), and a task's input is always storable.
    """
    headers = letter.headers
    returns = _count(headers)
    crashes = crash_limit(world.limit)
    consumed = kind in ("task", "request", "resume", "cancel", "signal", "reply", "progress")
    reason = headers.get(HEADER_REASON)
    if hostile_tag(letter.body) in world.observed.hostile_sent:
        if reason in HOSTILE_REASONS:
            return None
        return f"a hostile message dead-lettered as {reason!r}, not {sorted(HOSTILE_REASONS)}"
    spec = world.specs.get(_task_of(letter, kind) or "") if kind != "answer" else None
    if kind == "answer":
        spec = world.specs.get(str(letter.properties.get("correlation_id")))
        if reason == "refused" and spec is not None and queue.startswith(FULL):
            return None  # its publisher let its queue stay full longer than the workers try
        if reason == "refused" and queue == SIGNALS and world.scenario.nack_rate > 0:
            return None  # a signal's answer the broker nacked each time it was tried in place
        limit = world.scenario.broker_max_bytes
        if reason == "too-large" and spec is not None and limit and spec.big > limit:
            return None  # a result the workers may send and the broker refuses
    if headers.get("x-first-death-reason") == "delivery_limit":
        if consumed and returns > crashes + 1:
            return None
        return f"the broker's delivery limit, taken back {returns} times"
    detail = str(headers.get("x-waystation-detail", ""))
    if reason == "delivery-limit":
        if kind in ("cancel", "signal", "reply", "progress") and returns > crashes:
            return None
        return f"delivery-limit, taken back {returns} times"
    if reason == "handler-failed" and kind in ("task", "request", "resume"):
        error_type = detail.split(":", 1)[0]
        if error_type == "DeliveryLimitReached":
            return None if returns > crashes else f"{detail}, taken back {returns} times"
        if spec is None or kind == "request":
            return f"handler-failed ({detail}): its input never makes its handler fail"
        flaky = spec.fails > 0 and (spec.agent == "researcher" or world.scenario.has("handler"))
        if (
            (error_type == "RuntimeError" and flaky)
            or (error_type == "InvalidTransition" and spec.bad is not None)
            or (error_type == "Permanent" and spec.permanent and world.scenario.has("handler"))
            or (error_type == "MessageTooLarge" and spec.big > MAX_MESSAGE)
        ):
            return None
        return f"handler-failed ({detail}), not something {spec.task_id} can do"
    if reason == "unstorable" and kind == "reply" and unstorable(_body(letter.body)) is not None:
        return None
    return f"the reason {reason!r} is not one this scenario can produce"


HOSTILE_REASONS = frozenset({"undecodable-metadata", "invalid-json"})
"""What a hostile message here is dead-lettered as: its metadata does not decode, or (a header
that is not UTF-8, which decodes, on a body cut short) its body is not JSON."""


def hostile_tag(body: bytes) -> str | None:
    """The tag of a hostile publisher's message (``.hostile``), from its body,
    JSON or cut short; None for any other message."""
    marker = b'{"hostile": "'
    if not body.startswith(marker):
        return None
    return body[len(marker) :].split(b'"', 1)[0].decode(errors="replace")


def _task_of(letter: StoredMessage, kind: str) -> str | None:
    if kind == "resume":
        with contextlib.suppress(Exception):
            return str(loads(letter.body)["task_id"])
        return None
    return letter.properties.get("message_id")


# ---- 6. every ack follows its effect (G1) ------------------------------------------------------


def _acks_follow_their_effect(world: _World) -> list[str]:
    found = []
    for acked in world.observed.chronicle.acked:
        delivery = acked.delivery
        kind = _kind(delivery.type, delivery.queue, world, delivery.message_id)
        missing = _missing_effect(world, acked, kind)
        if missing is not None:
            found.append(
                f"{acked.worker} acked {kind} {delivery.message_id} from {delivery.queue} before "
                f"{missing} (G1)"
            )
    return found


def _missing_effect(world: _World, acked: Acked, kind: str) -> str | None:
    """What ``acked``'s delivery should have left before its ack, and had not (None: it had).

    A dead letter is an effect of its own, and what it implies must be in the log before the
    ack too: a handler that failed for good ended its task (``TaskFailed``, or the task had
    ended already); an unstorable reply failed its call. Only at the delivery limit, or for an
    answer nobody can take, is the dead letter all there is."""
    delivery, seq = acked.delivery, acked.seq
    message_id = delivery.message_id or ""
    reason = _dead_letter_before(world, acked)
    task_id = _task_id(delivery, kind)
    events = world.streams.get(task_id, [])
    if reason == "handler-failed":
        if any(e.event_type in _TERMINAL and world.committed(e) < seq for e in events):
            return None
        return f"its failure ended {task_id} in the log"
    if reason is not None and reason != "unstorable":
        return None
    if kind == "reply":
        key = (delivery.correlation_id or "", delivery.message_id)
        if world.recorded.get(key, seq) < seq:
            return None
        return "its claim or ReplyIgnored committed"
    if kind in ("task", "request", "resume") and _sent_back_before(world, acked):
        return None
    if kind in ("task", "request"):
        if any(world.committed(e) < seq for e in events):
            return None
        if world.sent_before(f"{message_id}:result", seq):
            return None  # completed without peers: its answer is its only effect (G10)
        return "its events committed or its result was published"
    if kind == "resume":
        pause = _body(delivery.body).get("pause")
        after = False
        for event in events:
            if after and event.event_type != "ReplyIgnored" and world.committed(event) < seq:
                return None
            if event.event_type == "TaskResumed" and event.data["pause"] == pause:
                after = True
        return f"the run resumed from pause {pause} of {task_id} was recorded"
    if kind == "signal":
        recorded = any(
            e.event_type in ("SignalReceived", "SignalRefused")
            and e.data["signal_id"] == message_id
            and world.committed(e) < seq
            for e in events
        )
        answer = derived_id(derived_id(message_id, ":signal"), ":result")
        tried = [*world.sent_before(answer, seq), *world.refused_before(answer, seq)]
        if recorded or tried:
            return None
        return "its record (SignalReceived, SignalRefused) committed or its answer was published"
    if kind == "cancel":
        if not any(e.event_type in _TERMINAL and world.committed(e) < seq for e in events):
            return f"{task_id}'s end (its cancel, or what finished it) committed"
        if delivery.reply_to and not world.sent_before(f"{task_id}:cancel:result", seq):
            return "its answer was published"
    return None


def _task_id(delivery: Delivery, kind: str) -> str:
    """The task a delivery is about: its own id (a task, a request), or the one its body names
    (a resume, a cancel, a signal)."""
    if kind in ("resume", "cancel", "signal"):
        return str(_body(delivery.body).get("task_id", ""))
    return delivery.message_id or ""


def _dead_letter_before(world: _World, acked: Acked) -> str | None:
    """The reason of the dead letter a worker published of ``acked``'s delivery before the ack,
    if it did."""
    delivery = acked.delivery
    for sent in world.sent_before(
        delivery.message_id or "", acked.seq, exchange=world.names.dead_letter_exchange
    ):
        headers = sent.message.properties.get("headers") or {}
        if headers.get(HEADER_QUEUE) == delivery.queue:
            return str(headers.get(HEADER_REASON))
    return None


def _sent_back_before(world: _World, acked: Acked) -> bool:
    """Whether a copy of the delivery counting one more failed run went back to its queue
    before the ack (a retry)."""
    delivery = acked.delivery
    runs = delivery.headers.get(HEADER_ATTEMPTS, 0)
    return any(
        (s.message.properties.get("headers") or {}).get(HEADER_ATTEMPTS, 0) > runs
        for s in world.sent_before(
            delivery.message_id or "", acked.seq, exchange="", routing_key=delivery.queue
        )
    )


def _body(body: bytes) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        parsed = loads(body)
        if isinstance(parsed, dict):
            return parsed
    return {}
