"""What must hold when the broker says no, and publishers send what they should not (issue 28).

:func:`problems` requires, beside ``.invariants`` and
``.reality``:

1. no relay stalls: every message a committed event implies (a peer request, a resume, a
   result, a cancel) is tried (published or refused) within :data:`RELAY_BOUND` seconds of its
   commit, however the broker treats the other messages around it; only a message the broker
   refused itself waits longer (its backoff);
2. every message the broker refused is published (later, or by another worker before), or
   dead-lettered with a reason (the
   answers to a publisher's full queue among them: ``refused``, or ``too-large`` for a result
   over the broker's limit, whose publisher is told instead); a copy of a delivery that a
   worker sends back or dead-letters is tried in place and, refused, the delivery is settled
   another way (``.reality`` checks each ack's effect);
3. every message a hostile publisher sent ends as a dead letter with its reason
   (``reality.HOSTILE_REASONS``), found by the tag in its body; none is lost or left unsettled
   (the leftovers check).

What a refused message's task is answered with is checked with every task
(``invariants._task_problems``): its result, an ``undeliverable-result`` error, or its answer
kept as a dead letter when its publisher's queue stayed full longer than the workers try.
"""

from __future__ import annotations

from waystation.events import RecordedEvent
from waystation.protocol.wire import HEADER_REASON, TYPE_CANCEL, TYPE_RESULT, TYPE_RESUME, TYPE_TASK
from waystation.runtime.outbox import RELAY_LEASE

from .reality import hostile_tag
from .world import GONE, Observed

__all__ = ["RELAY_BOUND", "problems"]

RELAY_BOUND = 2 * RELAY_LEASE + 30.0
"""Seconds within which a committed message is tried: its writer at once, or, when the writer
died or its connection went, a relay after the outbox delay; a relay that died holding the row
holds its lease (twice over, in the worst runs), and storage failures and restarts add
seconds."""

_OUTBOX_KINDS = (TYPE_TASK, TYPE_RESUME, TYPE_RESULT, TYPE_CANCEL)


def problems(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    return [
        *_no_relay_stalls(observed, streams),
        *_refused_messages_end(observed),
        *_hostile_messages_are_dead_letters(observed),
    ]


def _implied(streams: dict[str, list[RecordedEvent]]) -> dict[str, float]:
    """Each message id a committed event implies, to when it committed (virtual seconds),
    derived from the events themselves."""
    implied: dict[str, float] = {}
    for task_id, events in streams.items():
        started = next((e for e in events if e.event_type == "TaskStarted"), None)
        reply_to = started.data.get("reply_to") if started is not None else None
        for position, event in enumerate(events):
            at = event.recorded_at.timestamp() if event.recorded_at else 0.0
            data = event.data
            kind = event.event_type
            if kind == "TaskPaused":
                for call in data["calls"]:
                    if call.get("kind", "call") == "call":  # a signal's or a timer's: none
                        implied.setdefault(call["subtask_id"], at)
            elif kind == "TaskResumed":
                for given_up in data.get("abandoned", ()):
                    if given_up["agent"]:  # a peer call a FirstK pause gave up
                        implied.setdefault(f"{given_up['subtask_id']}:cancel", at)
                following = events[position + 1 : position + 2]
                same_commit = bool(following) and following[0].tx_id == event.tx_id
                if not (same_commit and following[0].event_type != "ReplyIgnored"):
                    implied.setdefault(f"{task_id}:resume:{data['pause']}", at)
            elif kind == "ResultRecorded" and data["outcome"] == "timeout":
                if _is_call(events, data["subtask_id"]):
                    implied.setdefault(f"{data['subtask_id']}:cancel", at)
            elif kind == "TaskCancelled":
                for pending in data.get("pending", ()):
                    implied.setdefault(f"{pending['subtask_id']}:cancel", at)
            if kind in ("TaskCompleted", "TaskFailed", "TaskCancelled") and reply_to:
                implied.setdefault(f"{task_id}:result", at)
    return implied


def _no_relay_stalls(observed: Observed, streams: dict[str, list[RecordedEvent]]) -> list[str]:
    chronicle = observed.chronicle
    tried: dict[str, float] = {}
    for attempt in [*chronicle.sent, *chronicle.refused]:
        message_id = attempt.message.message_id
        tried[message_id] = min(tried.get(message_id, attempt.at), attempt.at)
    refused = {r.message.message_id for r in chronicle.refused}
    found = []
    for message_id, committed in _implied(streams).items():
        if message_id in refused:
            continue  # tried again on its own backoff: item 2
        first = tried.get(message_id)
        if first is None:
            if not _resumed_in_place(message_id, streams):
                found.append(f"{message_id} was committed and never published (G4)")
        elif first - committed > RELAY_BOUND:
            found.append(
                f"{message_id} was first published {first - committed:.0f}s after its commit: "
                f"a relay stalled (allowed {RELAY_BOUND:.0f}s)"
            )
    return found


def _resumed_in_place(message_id: str, streams: dict[str, list[RecordedEvent]]) -> bool:
    """Whether a resume that was never published had no need to be: the run went on in
    place in a later append (its outcome follows the resume in the stream)."""
    if ":resume:" not in message_id:
        return False
    task_id, _, pause = message_id.rpartition(":resume:")
    events = streams.get(task_id, [])
    after = False
    for event in events:
        if event.event_type == "TaskResumed" and str(event.data["pause"]) == pause:
            after = True
        elif after and event.event_type != "ReplyIgnored":
            return True
    return False


def _refused_messages_end(observed: Observed) -> list[str]:
    chronicle = observed.chronicle
    taken: set[str] = {s.message.message_id for s in chronicle.sent if s.message.exchange == ""}
    dead: set[str] = set()
    for letter in observed.dead_letters:
        reason = letter.headers.get(HEADER_REASON) or letter.headers.get("x-first-death-reason")
        if not reason:
            continue
        for key in ("message_id",):
            value = letter.properties.get(key)
            if value:
                dead.add(str(value))
        original = letter.headers.get("x-waystation-message-id")
        if original:
            dead.add(str(original))
    found = []
    for refusal in chronicle.refused:
        message = refusal.message
        if message.exchange != "" or message.properties.get("type") not in _OUTBOX_KINDS:
            continue  # a copy to the dead-letter exchange: its delivery is settled otherwise
        headers = message.properties.get("headers") or {}
        if "x-waystation-attempts" in headers or "x-waystation-waits" in headers:
            # a retry's or a wait's copy of a delivery: tried in place, and refused, its delivery
            # goes back to its queue (reality: each ack's effect). (A resume after a run in
            # place failed carries the count too: its stream must end, as every stream must)
            continue
        if message.routing_key == GONE:
            continue
        if message.message_id in taken or message.message_id in dead:
            continue  # (published before counts too: a relay that sent a copy again was refused)
        found.append(
            f"{message.message_id} to {message.routing_key} was refused ({refusal.reason}) "
            "and was neither published later nor dead-lettered with a reason"
        )
    return found


def _hostile_messages_are_dead_letters(observed: Observed) -> list[str]:
    found = []
    letters = {
        hostile_tag(letter.body): letter.headers.get(HEADER_REASON)
        for letter in observed.dead_letters
        if hostile_tag(letter.body) is not None
    }
    for tag, (what, queue) in observed.hostile_sent.items():
        if tag not in letters:
            found.append(f"hostile message {tag} ({what} to {queue}) was not dead-lettered")
        elif not letters[tag]:
            found.append(f"hostile message {tag} was dead-lettered without a reason")
    return found


def _is_call(events: list[RecordedEvent], wait: str) -> bool:
    """Whether ``wait`` is a peer call (not a signal's wait or a timer) of a pause of
    ``events``."""
    return any(
        call["subtask_id"] == wait and call.get("kind", "call") == "call"
        for event in events
        if event.event_type == "TaskPaused"
        for call in event.data["calls"]
    )
