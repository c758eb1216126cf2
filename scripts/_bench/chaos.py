"""The pieces of ``scripts/chaos`` that are not the run itself.

* :func:`plan_faults`: when each fault lands, a pure function of the seed: the kinds shuffled,
  one per equal slice of the results, at a random point of its slice, after a random delay.
* :class:`ChaosCollector`: the durable result collector of the tests, which also says how many
  tasks have a result and waits for more; its messages carry their ``redelivered`` flag, so
  that a result the broker delivered again (the collector's ack was lost with its connection)
  is told apart from one a worker published twice.
* :func:`probe_health`: one worker's ``/healthz`` (healthy, and messages in its handlers).

What is missing, wrong or duplicated, from the result messages and from the event log, is
checked by :mod:`scripts.lab.harness.checks` (``log_figures``) and here, per kind of task
(:func:`answer_figures`).

When the broker says no (docs/failures.md):

* :func:`plan_tasks`: which tasks are special, a pure function of the seed: a share whose
  ``reply_to`` is a full queue that rejects publishes (drained late, or never), a share whose
  result is larger than a message may be (over the workers' limit, or over the broker's);
  :func:`expected_answer` says what each must get;
* :func:`hostile_message`: content headers no client library writes (:data:`HOSTILE_KINDS`),
  each body tagged, and :func:`hostile_figures`: what became of each (dead-lettered with the
  reason its kind expects, or refused by RabbitMQ itself);
* :func:`answer_figures`: every task answered as its kind expects, by a result or a dead letter,
  and every dead letter explained;
* :func:`counter_values`: a counter of a worker's ``/metrics`` by label.
"""

from __future__ import annotations

import asyncio
import random
import re
import struct
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aio_pika
import aiohttp
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

from scripts.lab.harness.clients import DurableResultCollector
from waystation.brokers.amqp.deadletters import DeadLetter
from waystation.events import canonical
from waystation.events.codec import dumps, loads
from waystation.protocol.wire import CONTENT_TYPE, TYPE_TASK

__all__ = [
    "FAULT_KINDS",
    "FILLER_TYPE",
    "FULL_KINDS",
    "HOSTILE_KINDS",
    "OVERSIZED_KINDS",
    "TASK_KINDS",
    "AnswerFigures",
    "ChaosCollector",
    "Expected",
    "Health",
    "HostileFigures",
    "HostileSent",
    "PlannedFault",
    "TaskMix",
    "answer_figures",
    "counter_values",
    "expected_answer",
    "hostile_figures",
    "hostile_message",
    "hostile_plan",
    "hostile_tag",
    "letter_task_id",
    "plan_faults",
    "plan_tasks",
    "probe_health",
    "raw_properties",
]

FAULT_KINDS = ("kill", "close", "pg-restart")


# ---- the fault plan ------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    """``kill`` (SIGKILL a worker, start a replacement), ``close`` (every broker connection of
    the run's vhost) or ``pg-restart`` (the run's PostgreSQL cluster stopped and started)."""
    after_results: int
    """It lands once this many results are in..."""
    delay: float
    """...and this many seconds later (a random moment in whatever is in flight)."""


def plan_faults(
    results_span: int, kills: int, closes: int, pg_restarts: int, seed: int
) -> list[PlannedFault]:
    """The faults in the order they land, spread over the first ``results_span`` results: the
    span is cut into one equal slice per fault, each fault lands at a random point of its slice
    (so no two pile up, and none waits for the end)."""
    kinds = ["kill"] * kills + ["close"] * closes + ["pg-restart"] * pg_restarts
    rng = random.Random(seed)
    rng.shuffle(kinds)
    width = results_span / max(1, len(kinds))
    return [
        PlannedFault(
            kind,
            max(1, int(width * (index + rng.random()))),
            round(rng.uniform(0.0, 1.0), 3),
        )
        for index, kind in enumerate(kinds)
    ]


# ---- the tasks: which are special, and what each must get ----------------------------------

TASK_KINDS = ("normal", "full-drained", "full-never", "over-worker", "over-broker")
"""``normal``: the example job, answered with its total. ``full-drained``: its ``reply_to`` is a
queue that rejects publishes (``x-overflow: reject-publish``), kept full a while and then
drained: its result is refused, retried with backoff by the outbox, and arrives.
``full-never``: the same, never drained: its result is refused until the workers'
``WAYSTATION_REFUSED_RETRY_SECONDS`` have passed, then dead-lettered (``refused``); that dead
letter is its answer. ``over-worker``: its result is larger than the workers'
``WAYSTATION_MAX_MESSAGE_BYTES`` allows: the task fails at once (``MessageTooLarge``) and its
publisher gets that error. ``over-broker``: its result fits the workers' limit but not the
broker's ``max_message_size``: dead-lettered (``too-large``), its publisher gets an
``undeliverable-result`` error."""
FULL_KINDS = ("full-drained", "full-never")
OVERSIZED_KINDS = ("over-worker", "over-broker")


@dataclass(frozen=True)
class TaskMix:
    """What share of the tasks is special (see :data:`TASK_KINDS`)."""

    full_share: float = 0.0
    """Tasks whose ``reply_to`` is a full queue that rejects publishes..."""
    never_drained: float = 0.0
    """...of which this fraction is never drained."""
    oversized_share: float = 0.0
    """Tasks whose result is larger than a message may be..."""
    over_broker: bool = False
    """...half of them over the broker's limit (when it has one here), the rest over the
    workers'."""


def _share(tasks: int, share: float) -> int:
    """``share`` of ``tasks``, at least one when the share is not zero."""
    return 0 if share <= 0 else max(1, round(tasks * share))


def _split(count: int, fraction: float) -> int:
    """The part of ``count`` that ``fraction`` asks for, at least one of each side when there are
    two or more and the fraction is strictly between 0 and 1."""
    if count == 0 or fraction <= 0:
        return 0
    if fraction >= 1:
        return count
    part = round(count * fraction)
    return min(count - 1, max(1, part)) if count >= 2 else part


def plan_tasks(tasks: int, held_back: int, mix: TaskMix, seed: int) -> list[str]:
    """The kind of each task, by position (a pure function of the seed). The special ones are
    drawn among the first ``tasks - held_back``: the held-back tail (submitted once every fault
    has landed) stays plain, so that the run does not end waiting for a special one."""
    eligible = max(0, tasks - held_back)
    full = _share(tasks, mix.full_share)
    never = _split(full, mix.never_drained)
    oversized = _share(tasks, mix.oversized_share)
    over_broker = _split(oversized, 0.5) if mix.over_broker else 0
    wanted = (
        ["full-never"] * never
        + ["full-drained"] * (full - never)
        + ["over-broker"] * over_broker
        + ["over-worker"] * (oversized - over_broker)
    )
    if len(wanted) > eligible:
        raise ValueError(f"{len(wanted)} special tasks do not fit in the first {eligible}")
    kinds = ["normal"] * tasks
    rng = random.Random(seed + 2)
    for index, kind in zip(rng.sample(range(eligible), len(wanted)), wanted, strict=True):
        kinds[index] = kind
    return kinds


@dataclass(frozen=True)
class Expected:
    """What one task must get."""

    kind: str
    result: Any
    """The result of its ``ok`` answer (also what the dead letter of a ``full-never`` task
    holds); None when its answer is an error."""
    error_type: str | None = None
    """The ``error.type`` of its error answer."""
    letter: str | None = None
    """Answered by a dead letter of this reason instead of a result (``full-never``)."""
    may_letter: frozenset[str] = frozenset()
    """Reasons of the dead letters of its messages that its kind explains."""


def expected_answer(kind: str, result: Any) -> Expected:
    """What a task of ``kind`` (:data:`TASK_KINDS`) whose job sums to ``result`` must get."""
    if kind in ("normal", "full-drained"):
        return Expected(kind, result)
    if kind == "full-never":
        return Expected(kind, result, letter="refused", may_letter=frozenset({"refused"}))
    if kind == "over-worker":
        # failed at once; when its resumed run came as a message (its worker died holding the
        # last reply), that message is dead-lettered as the failure's cause
        return Expected(
            kind, None, error_type="MessageTooLarge", may_letter=frozenset({"handler-failed"})
        )
    if kind == "over-broker":
        # (the result may be dead-lettered twice: once as the broker closed the channel it
        # came on, again when a relay met its row)
        return Expected(
            kind, None, error_type="undeliverable-result", may_letter=frozenset({"too-large"})
        )
    raise ValueError(f"no such kind of task: {kind!r}")


_SUBTASK = re.compile(r"^(?P<task>.+):\d+:\d+$")


def letter_task_id(letter: DeadLetter, tasks: Collection[str]) -> str | None:
    """The task (one of ``tasks``) a dead letter is about: its body's ``task_id`` (a result, a
    resume), its correlation id (a result's is its task's), its message id (``<task>:result``),
    or the task whose call it is (``<task>:<pause>:<i>``); None when none is a task."""
    candidates: list[Any] = []
    try:
        body = loads(letter.body)
        if isinstance(body, dict):
            candidates.append(body.get("task_id"))
    except Exception:
        pass
    candidates += [letter.correlation_id, letter.message_id]
    for candidate in candidates:
        if not isinstance(candidate, str):
            continue
        call = _SUBTASK.match(candidate)
        for name in (candidate, candidate.removesuffix(":result"), call and call["task"]):
            if name and name in tasks:
                return name
    return None


def _decoded(body: bytes) -> Any:
    try:
        return loads(body)
    except Exception:
        return None


def _matches(expected: Expected, answer: Any) -> bool:
    """Whether a result message's body is the answer ``expected`` asks for: ``ok`` with the
    result, or an error of the type (its message may differ between two copies: it names
    what the broker said each time)."""
    if not isinstance(answer, dict):
        return False
    if expected.error_type is not None:
        error = answer.get("error")
        return (
            answer.get("status") == "error"
            and isinstance(error, dict)
            and error.get("type") == expected.error_type
        )
    return bool(answer.get("status") == "ok" and answer.get("result") == expected.result)


EXAMPLES = 5


@dataclass
class AnswerFigures:
    messages: int
    """Result messages received, repeats included."""
    answered: int
    """Tasks answered: with a result, or (``full-never``) with their dead letter."""
    by_result: int
    by_letter: int
    missing: list[str]
    """Tasks without any answer."""
    wrong: list[str]
    """Tasks answered otherwise than their kind expects (another result, an error of another
    type, two different results, a result where a dead letter was due or the reverse)."""
    duplicates: int
    """Result messages beyond the first of their task."""
    duplicates_redelivered: int
    """Of those, delivered again by the broker (the collector's ack died with its connection)."""
    duplicated_tasks: list[str]
    unexpected: int
    """Result messages of no submitted task."""
    letters: int
    """Dead letters of the tasks' messages."""
    unexplained_letters: list[str]
    """Dead letters of a task whose kind does not explain them, or of no task at all."""
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per kind: tasks, answered, by result, by dead letter."""

    @property
    def duplicates_published(self) -> int:
        return self.duplicates - self.duplicates_redelivered

    def to_json(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "answered": self.answered,
            "answered_by_result": self.by_result,
            "answered_by_dead_letter": self.by_letter,
            "missing": len(self.missing),
            "wrong": len(self.wrong),
            "duplicates": self.duplicates,
            "duplicates_redelivered_to_collector": self.duplicates_redelivered,
            "duplicates_published_again": self.duplicates_published,
            "unexpected": self.unexpected,
            "dead_letters_of_tasks": self.letters,
            "unexplained_dead_letters": len(self.unexplained_letters),
            "by_kind": self.by_kind,
            "examples": {
                "missing": self.missing[:EXAMPLES],
                "wrong": self.wrong[:EXAMPLES],
                "duplicated": self.duplicated_tasks[:EXAMPLES],
                "unexplained_dead_letters": self.unexplained_letters[:EXAMPLES],
            },
        }


def answer_figures(
    expected: Mapping[str, Expected],
    messages: Iterable[tuple[str | None, bytes, bool]],
    letters: Iterable[DeadLetter],
) -> AnswerFigures:
    """Compare every result message (task id, body, redelivered) and every dead letter that is
    not a hostile message's with what each task must get (``expected``).

    A task expecting a result must have one or more result messages, all the same answer (the
    same body for an ``ok``; the same error type for an error) and that answer; none of its
    messages may be dead-lettered unless its kind explains it. A ``full-never`` task must have
    no result and a dead letter ``refused`` holding its ``ok`` result."""
    bodies: dict[str, list[bytes]] = {}
    redelivered_duplicates = unexpected = total = 0
    for task_id, body, redelivered in messages:
        total += 1
        if task_id is None or task_id not in expected:
            unexpected += 1
            continue
        seen = bodies.setdefault(task_id, [])
        if seen and redelivered:
            redelivered_duplicates += 1
        seen.append(body)
    kept: dict[str, list[DeadLetter]] = {}
    unexplained: list[str] = []
    count = 0
    for letter in letters:
        count += 1
        task_id = letter_task_id(letter, expected)
        if task_id is None or letter.reason not in expected[task_id].may_letter:
            unexplained.append(
                f"{task_id or letter.message_id}: {letter.reason} ({letter.detail[:120]})"
            )
            continue
        kept.setdefault(task_id, []).append(letter)
    missing, wrong = [], []
    by_kind: dict[str, Counter[str]] = {}
    by_result = by_letter = 0
    for task_id, want in expected.items():
        tally = by_kind.setdefault(want.kind, Counter())
        tally["tasks"] += 1
        received = bodies.get(task_id, [])
        if want.letter is not None:
            answers = [
                letter
                for letter in kept.get(task_id, [])
                if letter.reason == want.letter and _matches(want, _decoded(letter.body))
            ]
            if received or (kept.get(task_id) and not answers):
                wrong.append(task_id)
            elif not answers:
                missing.append(task_id)
            else:
                by_letter += 1
                tally["answered"] += 1
                tally["by_dead_letter"] += 1
            continue
        if not received:
            missing.append(task_id)
            continue
        if want.error_type is None:
            same = len({_canonical_or_raw(body) for body in received}) == 1
        else:
            same = True  # (compared by type below)
        if not same or not all(_matches(want, _decoded(body)) for body in received):
            wrong.append(task_id)
            continue
        by_result += 1
        tally["answered"] += 1
        tally["by_result"] += 1
    duplicated = [t for t, received in bodies.items() if len(received) > 1]
    return AnswerFigures(
        messages=total,
        answered=by_result + by_letter,
        by_result=by_result,
        by_letter=by_letter,
        missing=missing,
        wrong=wrong,
        duplicates=sum(len(bodies[t]) - 1 for t in duplicated),
        duplicates_redelivered=redelivered_duplicates,
        duplicated_tasks=duplicated,
        unexpected=unexpected,
        letters=count,
        unexplained_letters=unexplained,
        by_kind={kind: dict(tally) for kind, tally in by_kind.items()},
    )


def _canonical_or_raw(body: bytes) -> bytes:
    try:
        return canonical(loads(body))
    except Exception:
        return body


# ---- hostile publishers ----------------------------------------------------------------------

_FLAGS = {
    "content_type": 0x8000,
    "content_encoding": 0x4000,
    "headers": 0x2000,
    "delivery_mode": 0x1000,
    "priority": 0x0800,
    "correlation_id": 0x0400,
    "reply_to": 0x0200,
    "expiration": 0x0100,
    "message_id": 0x0080,
    "timestamp": 0x0040,
    "type": 0x0020,
    "user_id": 0x0010,
    "app_id": 0x0008,
}
"""The property flags of class Basic, in the order their values follow the flag word."""


def _short(value: bytes) -> bytes:
    return bytes((len(value),)) + value


def _table(entries: Sequence[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(_short(key) + value for key, value in entries)
    return struct.pack(">I", len(body)) + body


def _nested(depth: int) -> bytes:
    table = struct.pack(">I", 0)
    for _ in range(depth):
        entry = _short(b"k") + b"F" + table
        table = struct.pack(">I", len(entry)) + entry
    return table


def raw_properties(**values: bytes) -> bytes:
    """A content header's properties as AMQP bytes, from the flag word on: each value given
    already encoded, whatever it holds (``publish_raw_properties`` sends them as they are)."""
    flags, encoded = 0, b""
    for name, flag in _FLAGS.items():
        if name in values:
            flags |= flag
            encoded += values[name]
    return struct.pack(">H", flags) + encoded


def _long_string(value: bytes, *, length: int | None = None) -> bytes:
    return b"S" + struct.pack(">I", len(value) if length is None else length) + value


def _hostile_properties(kind: str, tag: bytes, reply_to: bytes) -> tuple[bytes, bool]:
    """The properties of a hostile message of ``kind``, and whether its body is JSON."""
    base = {"delivery_mode": b"\x02", "reply_to": _short(reply_to)}
    if kind == "message-id-not-utf8":
        # (its correlation id names it in the error its publisher gets)
        return raw_properties(
            **base, correlation_id=_short(tag), message_id=_short(b"\xff\xfe" + tag)
        ), True
    if kind == "correlation-id-not-utf8":
        return raw_properties(
            **base, correlation_id=_short(b"\xc3\x28"), message_id=_short(tag)
        ), True
    if kind == "headers-nested-3000-deep":
        return raw_properties(**base, headers=_nested(3000), message_id=_short(tag)), True
    if kind == "header-key-not-utf8":
        return raw_properties(
            **base, headers=_table([(b"\xff\xfe", b"t\x01")]), message_id=_short(tag)
        ), True
    if kind == "timestamp-past-year-9999":
        return raw_properties(
            **base, message_id=_short(tag), timestamp=struct.pack(">Q", 2**62)
        ), True
    if kind == "type-not-utf8":
        return raw_properties(**base, message_id=_short(tag), type=_short(b"\xff" + tag)), True
    if kind == "long-string-not-utf8-invalid-body":
        odd = _table([(b"x-odd", _long_string(b"\xff\xfe" * 8))])
        return raw_properties(**base, headers=odd, message_id=_short(tag)), False
    if kind == "unknown-field-type-tag":
        return raw_properties(
            **base, headers=_table([(b"x-odd", b"Z\x00\x00")]), message_id=_short(tag)
        ), True
    if kind == "table-length-lies":
        lying = struct.pack(">I", 500) + _short(b"x-odd") + b"t\x01"
        return raw_properties(**base, headers=lying, message_id=_short(tag)), True
    if kind == "long-string-length-lies":
        lying = _table([(b"x-odd", _long_string(b"ab", length=1000))])
        return raw_properties(**base, headers=lying, message_id=_short(tag)), True
    raise ValueError(f"no such hostile kind: {kind!r}")


HOSTILE_KINDS: dict[str, str | None] = {
    "message-id-not-utf8": "undecodable-metadata",
    "correlation-id-not-utf8": "undecodable-metadata",
    "headers-nested-3000-deep": "undecodable-metadata",
    "header-key-not-utf8": "undecodable-metadata",
    "timestamp-past-year-9999": "undecodable-metadata",
    "type-not-utf8": "undecodable-metadata",
    "long-string-not-utf8-invalid-body": "invalid-json",
    "unknown-field-type-tag": None,
    "table-length-lies": None,
    "long-string-length-lies": None,
}
"""Each kind of hostile message, and the reason its dead letter must give; None for the kinds
RabbitMQ 3.10 refuses itself (it cannot parse the header table: it closes the publisher's
connection, ``541 INTERNAL_ERROR``, and nothing reaches a worker). A message of such a kind that
RabbitMQ did take must be dead-lettered all the same, with any reason."""

HOSTILE_TAG = re.compile(rb"hostile-\d+-\d+")


def hostile_message(kind: str, tag: str, reply_to: str) -> tuple[bytes, bytes]:
    """(properties, body) of a hostile message of ``kind`` (:data:`HOSTILE_KINDS`): the body
    carries ``tag``, so that its dead letter can be found; its errors go to ``reply_to``."""
    properties, json_body = _hostile_properties(kind, tag.encode(), reply_to.encode())
    body = dumps({"hostile": tag, "kind": kind}) if json_body else b"{not json " + tag.encode()
    return properties, body


def hostile_plan(count: int, seed: int) -> list[str]:
    """The kinds of ``count`` hostile messages: every kind in turn, each turn shuffled (a pure
    function of the seed), so that a few messages already hold a few of each."""
    rng = random.Random(seed + 3)
    kinds: list[str] = []
    while len(kinds) < count:
        turn = list(HOSTILE_KINDS)
        rng.shuffle(turn)
        kinds += turn
    return kinds[:count]


@dataclass
class HostileSent:
    """One hostile message and what its publisher saw."""

    tag: str
    kind: str
    queue: str
    outcome: str = "not sent"
    """``routed`` (the broker took it), ``refused`` (RabbitMQ closed the connection, 541:
    it refused it itself) or ``error`` (something else went wrong: every try failed)."""
    tries: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class HostileFigures:
    sent: int
    routed: int
    refused_by_broker: int
    dead_lettered: int
    reasons: Counter[str]
    missing: list[str]
    """Taken by the broker and dead-lettered by nobody (lost or stuck)."""
    wrong_reason: list[str]
    """Dead-lettered with another reason than its kind's, or refused by RabbitMQ although of a
    kind it takes, or never sent."""
    letters: int
    """Dead letters of hostile messages, repeats included."""
    answers: Counter[str]
    """Error answers their publisher got, by ``error.type``."""
    wrong_answers: list[str]
    """Answers that are no error, or an error of another type than the dead letter's reason."""
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "routed": self.routed,
            "refused_by_rabbitmq": self.refused_by_broker,
            "dead_lettered": self.dead_lettered,
            "reasons": dict(sorted(self.reasons.items())),
            "missing": len(self.missing),
            "wrong_reason": len(self.wrong_reason),
            "dead_letters": self.letters,
            "answered_with_error": dict(sorted(self.answers.items())),
            "wrong_answers": len(self.wrong_answers),
            "by_kind": self.by_kind,
            "examples": {
                "missing": self.missing[:EXAMPLES],
                "wrong_reason": self.wrong_reason[:EXAMPLES],
                "wrong_answers": self.wrong_answers[:EXAMPLES],
            },
        }


def hostile_tag(body: bytes) -> str | None:
    found = HOSTILE_TAG.search(body)
    return found.group().decode() if found else None


def hostile_figures(
    sent: Sequence[HostileSent],
    letters: Iterable[DeadLetter],
    answers: Iterable[tuple[str | None, bytes]],
) -> HostileFigures:
    """What became of each hostile message: every one the broker took must be dead-lettered
    with its kind's reason (:data:`HOSTILE_KINDS`); one RabbitMQ refused itself must be of a
    kind it refuses. ``letters``: the hostile ones among the dead letters (found by their
    tag); ``answers``: (correlation id, body) of the error results the workers sent back."""
    found: dict[str, list[str]] = {}
    count = 0
    for letter in letters:
        tag = hostile_tag(letter.body)
        if tag is not None:
            count += 1
            found.setdefault(tag, []).append(letter.reason)
    reasons: Counter[str] = Counter()
    missing, wrong = [], []
    by_kind: dict[str, Counter[str]] = {}
    for message in sent:
        tally = by_kind.setdefault(message.kind, Counter())
        tally["sent"] += 1
        want = HOSTILE_KINDS[message.kind]
        got = found.get(message.tag, [])
        if got:
            reasons[got[0]] += 1
            tally[got[0]] += 1
            if want is not None and any(reason != want for reason in got):
                wrong.append(f"{message.tag} ({message.kind}): {sorted(set(got))}, not {want}")
        elif message.outcome == "refused":
            tally["refused by RabbitMQ"] += 1
            if want is not None:
                wrong.append(
                    f"{message.tag} ({message.kind}): refused by RabbitMQ {message.errors[-1:]}"
                )
        elif message.outcome == "routed":
            missing.append(f"{message.tag} ({message.kind}): taken, never dead-lettered")
        else:
            # every try failed otherwise: maybe taken, maybe not; the run cannot tell
            wrong.append(f"{message.tag} ({message.kind}): not sent {message.errors[-1:]}")
    answered: Counter[str] = Counter()
    wrong_answers = []
    wanted = {m.tag: found.get(m.tag, [None])[0] for m in sent}
    for correlation_id, body in answers:
        answer = _decoded(body)
        error = answer.get("error") if isinstance(answer, dict) else None
        kind = error.get("type") if isinstance(error, dict) else None
        answered[str(kind)] += 1
        tag = correlation_id if correlation_id in wanted else hostile_tag(body)
        if (
            not isinstance(answer, dict)
            or answer.get("status") != "error"
            or (tag in wanted and wanted[tag] is not None and kind != wanted[tag])
        ):
            wrong_answers.append(f"{tag}: {body[:200]!r}")
    return HostileFigures(
        sent=len(sent),
        routed=sum(m.outcome == "routed" for m in sent),
        refused_by_broker=sum(m.outcome == "refused" for m in sent),
        dead_lettered=sum(1 for m in sent if m.tag in found),
        reasons=reasons,
        missing=missing,
        wrong_reason=wrong,
        letters=count,
        answers=answered,
        wrong_answers=wrong_answers,
        by_kind={kind: dict(tally) for kind, tally in by_kind.items()},
    )


# ---- a worker's counters -------------------------------------------------------------------


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def counter_values(exposition: str, name: str) -> dict[str, float]:
    """The samples of counter ``name`` (``..._total``) in a Prometheus text exposition, by the
    value of their first label ("" when they have none)."""
    values: dict[str, float] = {}
    for line in exposition.splitlines():
        sample = _SAMPLE.match(line.strip())
        if sample is None or sample["name"] != f"{name}_total":
            continue
        labels = sample["labels"] or ""
        label = labels.split("=", 1)[1].split(",", 1)[0].strip('"') if "=" in labels else ""
        try:
            values[label] = values.get(label, 0.0) + float(sample["value"])
        except ValueError:
            continue
    return values


# ---- results -------------------------------------------------------------------------------

FILLER_TYPE = "chaos-filler"
"""The type of the messages that keep a full queue full (the run's, not results)."""


class ChaosCollector(DurableResultCollector):
    """:class:`~scripts.lab.harness.clients.DurableResultCollector` that can wait until a number of
    tasks have their result, and that also answers for the run's other queues, each on its
    robust channel (restored with its consumers when the connection comes back):

    * full queues (:meth:`full_queue`): a classic queue of ``x-max-length`` that rejects
      publishes, declared and filled with that many fillers; :meth:`drain` consumes it (fillers
      dropped, results recorded as any other, counted in ``through_full``);
    * the queue where hostile messages' errors come back (:meth:`keep_answers`).

    The results of the tasks in ``uncounted`` (those answered through a full queue) are kept
    but not counted by :meth:`answered`: the run's window of tasks in flight leaves them out."""

    def __init__(self, amqp_url: str, *, queue_prefix: str) -> None:
        super().__init__(amqp_url, queue_prefix=queue_prefix, queue_name="chaos-results")
        self._arrived = asyncio.Condition()
        self.uncounted: set[str] = set()
        self._counted: set[str] = set()
        self.through_full: Counter[str] = Counter()
        """Per task, result messages that came through a full queue."""
        self.fillers_taken = 0
        self.answers: list[tuple[str | None, bytes]] = []
        """(correlation id, body) of every answer to a hostile message."""
        self._queues: dict[str, AbstractQueue] = {}

    async def _on_result(self, message: AbstractIncomingMessage) -> None:
        await super()._on_result(message)
        if message.correlation_id is not None and message.correlation_id not in self.uncounted:
            self._counted.add(message.correlation_id)
        async with self._arrived:
            self._arrived.notify_all()

    def answered(self) -> int:
        """Tasks with a result so far, those in ``uncounted`` aside."""
        return len(self._counted)

    async def wait_answered(self, count: int) -> None:
        """Until at least ``count`` tasks (``uncounted`` aside) have a result."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self._counted) >= count)

    async def submit_to(self, agent: str, input: Any, task_id: str, reply_to: str) -> None:
        """Submit a task as :meth:`submit` does, its result due on ``reply_to`` instead."""
        assert self._channel is not None
        await self._channel.default_exchange.publish(
            aio_pika.Message(
                dumps(input),
                message_id=task_id,
                correlation_id=task_id,
                reply_to=reply_to,
                type=TYPE_TASK,
                content_type=CONTENT_TYPE,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            ),
            routing_key=self.names.tasks(agent),
            mandatory=True,
        )

    async def full_queue(self, name: str, length: int) -> None:
        """Declare ``name``, a durable classic queue of at most ``length`` messages that rejects
        publishes past that (``x-overflow: reject-publish``), and fill it (again: it tops up
        what a call cut short by a dropped connection left)."""
        assert self._channel is not None
        queue = await self._channel.declare_queue(
            name,
            durable=True,
            arguments={
                "x-queue-type": "classic",
                "x-max-length": length,
                "x-overflow": "reject-publish",
            },
        )
        self._queues[name] = queue
        there = int(queue.declaration_result.message_count or 0)  # (filled before a drop)
        for number in range(there, length):
            await self._channel.default_exchange.publish(
                aio_pika.Message(
                    b"{}",
                    type=FILLER_TYPE,
                    correlation_id=f"filler-{number}",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                ),
                routing_key=name,
                mandatory=True,
            )

    async def drain(self, name: str) -> None:
        """Start consuming the full queue ``name``: from now on it is drained as results come."""
        await self._queues[name].consume(self._on_full)

    async def _on_full(self, message: AbstractIncomingMessage) -> None:
        if message.type == FILLER_TYPE:
            self.fillers_taken += 1
            await self._ack(message)
            return
        self.through_full[message.correlation_id or ""] += 1
        await self._on_result(message)

    async def keep_answers(self, name: str) -> None:
        """Declare ``name`` (a durable quorum queue) and keep every message that comes to it."""
        assert self._channel is not None
        queue = await self._channel.declare_queue(
            name, durable=True, arguments={"x-queue-type": "quorum"}
        )
        self._queues[name] = queue
        await queue.consume(self._on_answer)

    async def _on_answer(self, message: AbstractIncomingMessage) -> None:
        self.answers.append((message.correlation_id, bytes(message.body)))
        await self._ack(message)

    @staticmethod
    async def _ack(message: AbstractIncomingMessage) -> None:
        try:
            await message.ack()
        except (
            aio_pika.exceptions.AMQPError,
            aio_pika.exceptions.ChannelInvalidStateError,
            ConnectionError,
        ):
            pass  # the channel died first: the broker delivers it again


# ---- a worker's health ---------------------------------------------------------------------


@dataclass(frozen=True)
class Health:
    healthy: bool
    in_flight: int | None
    """Messages in the worker's handlers right now (None when it did not say)."""


async def probe_health(session: aiohttp.ClientSession, port: int) -> Health:
    """``GET /healthz`` of the worker listening on ``port`` (unhealthy when it does not answer)."""
    try:
        async with session.get(
            f"http://127.0.0.1:{port}/healthz", timeout=aiohttp.ClientTimeout(total=3)
        ) as response:
            body = loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return Health(False, None)
    in_flight = body.get("in_flight") if isinstance(body, dict) else None
    return Health(response.status == 200, in_flight if isinstance(in_flight, int) else None)
