"""A hostile publisher's messages: content headers no client library writes
(:func:`hostile_message`, :data:`HOSTILE_KINDS`), each body tagged, and :func:`hostile_figures`:
what became of each (dead-lettered with the reason its kind expects, or refused by RabbitMQ
itself)."""

from __future__ import annotations

import random
import re
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from waystation.brokers.amqp.deadletters import DeadLetter
from waystation.events.codec import dumps

from .answers import EXAMPLES, decoded

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
        answer = decoded(body)
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
