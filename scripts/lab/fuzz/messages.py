"""Hostile messages: what the fuzzer sends, drawn by hypothesis or written out as fixed cases.

A :class:`Draft` is everything drawn for one message but its fuzz id: each property present
(any combination of the 14 of class Basic) with its value as raw bytes, a bend of the content
header itself (the continuation bit, a reserved flag, bytes missing or left over, another class
id), and the kind of body. :meth:`Draft.message` gives it a fuzz id and writes the bytes: a
:class:`Message`, whose body always carries the fuzz id, so that its fate can be found whatever
became of its properties.

Values are malformed in every way AMQP lets them be: short strings that are not UTF-8, empty,
exactly 255 bytes (a last character cut in two included); header tables with every field type
(``t b B U u I i L l f d D s S x A T F V`` and the NUL that pamqp reads as void), long strings
that are not UTF-8, byte arrays, tables and arrays nested hundreds to thousands deep, huge tables,
repeated keys, keys that are not UTF-8 or longer than pamqp writes, type tags nobody knows, and
lengths that lie inside the header frame. Property values the broker is known to refuse are
drawn too (a ``user_id`` that is not the connection's user, an ``expiration`` that is not a
number): the fuzzer records the refusal.

:func:`drafts` collects drafts from hypothesis, reproducibly (derandomized, or from a seed);
:data:`FIXED` are the known triggers as fixed cases.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from .amqp import (
    I8,
    I16,
    I32,
    I64,
    PROPERTIES,
    U8,
    U16,
    U32,
    U64,
    array,
    content_header,
    longstr,
    nested,
    property_flags,
    shortstr,
    table,
)

__all__ = ["FIXED", "Draft", "Message", "drafts", "hostile_drafts"]

Value = tuple[bytes, str]
"""Bytes as they go on the wire, and what they are, for people."""


# ---- bytes for people ----------------------------------------------------------------------------


def shown(raw: bytes, limit: int = 24) -> str:
    return repr(raw[:limit]) + ("..." if len(raw) > limit else "")


def utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def _string(raw: bytes) -> str:
    """What a string of these bytes is."""
    if not raw:
        return "empty"
    kind = "UTF-8" if utf8(raw) else "not UTF-8"
    if b"\x00" in raw:
        kind += " with NUL"
    return f"{kind}, {len(raw)} bytes {shown(raw)}"


# ---- messages ----------------------------------------------------------------------------------

BODIES = ("runs", "raises-once", "invalid-json", "not-utf8", "unstorable")
"""Kinds of body. ``runs``: a task the handler completes; ``raises-once``: its first run
raises (the worker sends a copy back to retry it); the others are dead-lettered by the worker
(``invalid-json``, ``invalid-utf8``, ``unstorable``): its dead letter is a copy too."""


def body_of(kind: str, fuzz_id: str) -> bytes:
    fuzz = json.dumps(fuzz_id)
    if kind == "runs":
        return f'{{"fuzz": {fuzz}}}'.encode()
    if kind == "raises-once":
        return f'{{"fuzz": {fuzz}, "raise_once": true}}'.encode()
    if kind == "invalid-json":
        return f'{{"fuzz": {fuzz}, '.encode()
    if kind == "not-utf8":
        return f'{{"fuzz": {fuzz}, "x": "'.encode() + b'\xff\xfe"}'
    if kind == "unstorable":
        return f'{{"fuzz": {fuzz}, "x": "a\\u0000b"}}'.encode()
    raise ValueError(f"no body of kind {kind!r}")


@dataclass(frozen=True)
class Message:
    """One hostile message, its bytes ready to publish."""

    fuzz_id: str
    header: bytes
    """The content header frame's payload, as published."""
    body: bytes
    runs_wanted: int
    """Runs of the handler that complete it: 1, or 2 when the first raises (``raise_once``)."""
    parts: tuple[str, ...]
    """What is in it, a line each: the properties, the bend, the body."""

    def describe(self, indent: str = "    ") -> str:
        return "\n".join(indent + part for part in self.parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "fuzz_id": self.fuzz_id,
            "header_hex": self.header.hex(),
            "body_hex": self.body.hex(),
            "runs_wanted": self.runs_wanted,
            "parts": list(self.parts),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Message:
        return cls(
            data["fuzz_id"],
            bytes.fromhex(data["header_hex"]),
            bytes.fromhex(data["body_hex"]),
            int(data["runs_wanted"]),
            tuple(data["parts"]),
        )

    def save(self, path: Path) -> Path:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> Message:
        return cls.from_json(json.loads(path.read_text()))


@dataclass(frozen=True)
class Bend:
    """A change to the content header around the property values."""

    kind: str
    """``continuation`` (flag bit 0, no second flag word), ``continuation-word`` (bit 0 and a
    second word), ``reserved`` (flag bit 1), ``truncated`` (the last bytes of the values
    missing), ``trailing`` (bytes left over after them), ``class`` (another class id than 60),
    ``body-size`` (a body size smaller than the body)."""
    value: int = 0
    extra: bytes = b""

    def describe(self) -> str:
        return {
            "continuation": "flags: continuation bit (0x0001) set, no second flag word",
            "continuation-word": f"flags: continuation bit set, second flag word {self.value:#06x}",
            "reserved": "flags: reserved bit 0x0002 set",
            "truncated": f"the property values' last {self.value} bytes missing",
            "trailing": f"{len(self.extra)} bytes {shown(self.extra)} after the property values",
            "class": f"class id {self.value} (not 60)",
            "body-size": f"body size {self.value} bytes less than the body",
        }[self.kind]


@dataclass(frozen=True)
class Draft:
    """A hostile message but for its fuzz id: what hypothesis draws."""

    values: tuple[tuple[str, bytes, str], ...]
    """(property, its bytes as written after the flags, what they are), in the flags' order."""
    body: str = "runs"
    bend: Bend | None = None

    def message(self, fuzz_id: str, taken: set[bytes] | None = None) -> Message:
        """The message, with ``fuzz_id`` in its body (and as its message_id where the draft
        has the plain one). A message_id in ``taken`` (those a campaign sent already) is made
        distinct, and added: a task id the log recorded would be answered from the log, and
        not run again."""
        body = body_of(self.body, fuzz_id)
        chosen = [self._distinct(value, fuzz_id, taken) for value in self.values]
        flags = property_flags(name for name, _, _ in chosen)
        values = b"".join(raw for _, raw, _ in chosen)
        class_id, body_size, word = 60, len(body), b""
        bend = self.bend
        if bend is not None:
            if bend.kind == "continuation":
                flags |= 0x0001
            elif bend.kind == "continuation-word":
                flags |= 0x0001
                word = U16.pack(bend.value)
            elif bend.kind == "reserved":
                flags |= 0x0002
            elif bend.kind == "truncated":
                values = values[: max(0, len(values) - bend.value)]
            elif bend.kind == "trailing":
                values += bend.extra
            elif bend.kind == "class":
                class_id = bend.value
            elif bend.kind == "body-size":
                body_size = max(0, len(body) - bend.value)
        header = content_header(U16.pack(flags) + word + values, body_size, class_id=class_id)
        parts = [f"{name}: {what}" for name, _, what in chosen] or ["no properties"]
        if bend is not None:
            parts.append(bend.describe())
        parts.append(f"body: {self.body} ({shown(body, 60)})")
        runs = 2 if self.body == "raises-once" else 1
        return Message(fuzz_id, header, body, runs, tuple(parts))

    @staticmethod
    def _distinct(
        value: tuple[str, bytes, str], fuzz_id: str, taken: set[bytes] | None
    ) -> tuple[str, bytes, str]:
        name, encoded, what = value
        if name != "message_id":
            return value
        raw = encoded[1:]
        if raw == FUZZ_ID:
            raw, what = fuzz_id.encode(), f"the fuzz id ({fuzz_id})"
        elif taken is not None and raw in taken and raw and utf8(raw):
            raw = distinct(raw, taken)
            what = f"{_string(raw)} (its last characters made distinct)"
        if taken is not None:
            taken.add(raw)
        return name, shortstr(raw), what


FUZZ_ID = b"<the fuzz id>"
"""A message_id drawn as this is the message's fuzz id: plain, and never seen before."""


def distinct(raw: bytes, taken: set[bytes]) -> bytes:
    """``raw`` (UTF-8) with its last characters replaced by ASCII digits of as many bytes, so
    that it is in no ``taken``: the same length in bytes, still UTF-8, its start unchanged.
    One too short to hold a new number gets ``-<number>`` appended instead."""
    text = raw.decode()
    for number in range(1, 100_000):
        digits = str(number)
        cut, size = len(text), 0
        while cut > 0 and size < len(digits):
            cut -= 1
            size += len(text[cut].encode())
        if size < len(digits):
            break
        candidate = text[:cut].encode() + digits.zfill(size).encode()
        if candidate not in taken:
            return candidate
    number = 1
    while raw + f"-{number}".encode() in taken:
        number += 1
    return raw + f"-{number}".encode()


# ---- field values ------------------------------------------------------------------------------

NOT_UTF8 = (
    b"\xff",
    b"\xfe\xff",
    b"\x80",  # a continuation byte alone
    b"\xc0\xaf",  # an overlong encoding of "/"
    b"\xc3",  # a two-byte character cut short
    b"\xe2\x82",  # a three-byte one cut short
    b"\xed\xa0\x80",  # a UTF-16 surrogate
    b"\xf4\x90\x80\x80",  # past U+10FFFF
    b"\xf8\x88\x80\x80\x80",  # a five-byte form
)
EXACTLY_255 = (
    b"a" * 255,
    "é".encode() * 127 + b"a",
    "€".encode() * 85,
    "😀".encode() * 63 + b"abc",
    "é".encode() * 127 + b"\xc3",  # not UTF-8: the last character cut in two
)


def not_utf8(max_size: int = 255) -> st.SearchStrategy[bytes]:
    half = max(0, (max_size - 5) // 2)
    return (
        st.tuples(
            st.text(max_size=min(half, 20)).map(str.encode),
            st.sampled_from(NOT_UTF8),
            st.binary(max_size=min(half, 20)),
        )
        .map(lambda t: t[0] + t[1] + t[2])
        .filter(lambda raw: len(raw) <= max_size and not utf8(raw))
    )


def short_strings() -> st.SearchStrategy[bytes]:
    """The bytes of a short string: anything a short string can hold."""
    return st.one_of(
        st.text(max_size=40).map(str.encode).filter(lambda raw: len(raw) <= 255),
        st.just(b""),
        st.sampled_from(EXACTLY_255),
        not_utf8(),
        st.sampled_from([b"a\x00b", b"\x00"]),
        st.binary(min_size=1, max_size=255),
    )


def short_value(raw: bytes) -> Value:
    return shortstr(raw), _string(raw)


def long_strings() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.text(max_size=40).map(str.encode),
        st.just(b""),
        not_utf8(400),
        st.binary(max_size=64),
        st.sampled_from([1_000, 40_000, 70_000]).map(lambda n: b"y" * n),
    )


def _number(tag: bytes, packer: struct.Struct, low: int, high: int) -> st.SearchStrategy[Value]:
    return st.integers(low, high).map(lambda n: (tag + packer.pack(n), f"{tag.decode()} {n}"))


def scalar_values() -> st.SearchStrategy[Value]:
    """A field value that holds no other: every type tag of AMQP 0-9-1, RabbitMQ and pamqp."""
    return st.one_of(
        st.integers(0, 255).map(lambda n: (b"t" + U8.pack(n), f"t (boolean) {n}")),
        _number(b"b", I8, -128, 127),
        _number(b"B", U8, 0, 255),
        _number(b"U", I16, -(2**15), 2**15 - 1),  # the spec's short-int, which RabbitMQ reads as s
        _number(b"s", I16, -(2**15), 2**15 - 1),  # RabbitMQ's and pamqp's short-int
        _number(b"u", U16, 0, 2**16 - 1),
        _number(b"I", I32, -(2**31), 2**31 - 1),
        _number(b"i", U32, 0, 2**32 - 1),
        _number(b"L", U64, 0, 2**64 - 1),  # the spec's long-long-uint (pamqp reads it signed)
        _number(b"l", I64, -(2**63), 2**63 - 1),
        st.binary(min_size=4, max_size=4).map(lambda raw: (b"f" + raw, f"f (float) {shown(raw)}")),
        st.binary(min_size=8, max_size=8).map(lambda raw: (b"d" + raw, f"d (double) {shown(raw)}")),
        st.tuples(st.integers(0, 255), st.integers(0, 2**32 - 1)).map(
            lambda t: (b"D" + U8.pack(t[0]) + U32.pack(t[1]), f"D (decimal) {t[1]}e-{t[0]}")
        ),
        timestamps().map(lambda n: (b"T" + U64.pack(n), f"T (timestamp) {n}")),
        st.just((b"V", "V (void)")),
        st.just((b"\x00", "NUL tag (pamqp: void)")),
        long_strings().map(lambda raw: (b"S" + longstr(raw), f"S {_string(raw)}")),
        st.binary(max_size=64).map(lambda raw: (b"x" + longstr(raw), f"x (bytes) {shown(raw)}")),
        st.tuples(st.sampled_from(b"ZzNnOo?!\x01\x7f\xff"), st.binary(max_size=8)).map(
            lambda t: (bytes([t[0]]) + t[1], f"unknown type tag {bytes([t[0]])!r}")
        ),
    )


def lying_values() -> st.SearchStrategy[Value]:
    """A string, array or table whose length says more or less than what follows it."""

    def lie(tag: bytes, inner: bytes, delta: int) -> Value:
        claimed = max(0, len(inner) + delta)
        return tag + U32.pack(claimed) + inner, (
            f"{tag.decode()} of {len(inner)} bytes whose length says {claimed}"
        )

    return st.tuples(
        st.sampled_from([b"S", b"x", b"A", b"F"]),
        st.binary(max_size=16),
        st.one_of(st.integers(-16, -1), st.integers(1, 5000)),
    ).map(lambda t: lie(*t))


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of the strategies, each drawn about ``weight`` times in the sum of the weights (a
    plain ``one_of`` draws its branches about as often each)."""
    total = sum(weight for weight, _ in choices)

    def pick(number: int) -> st.SearchStrategy[Any]:
        for weight, strategy in choices:
            if number < weight:
                return strategy
            number -= weight
        raise AssertionError(number)

    return st.integers(0, total - 1).flatmap(pick)


def keys() -> st.SearchStrategy[bytes]:
    """Table keys: the headers Waystation and RabbitMQ read, and any others; sometimes empty,
    not UTF-8, or longer than the 128 bytes pamqp writes."""
    return weighted(
        (
            40,
            st.sampled_from(
                [
                    b"k",
                    b"dup",  # drawn often: tables with this key twice
                    b"x-waystation-attempts",
                    b"x-waystation-waits",
                    b"x-waystation-trace-id",
                    b"x-waystation-root-task",
                    b"x-waystation-reason",
                    b"traceparent",
                    b"x-delivery-count",
                    b"x-acquired-count",
                    b"x-death",
                ]
            ),
        ),
        (40, st.text(max_size=20).map(str.encode)),
        (5, st.just(b"")),
        (8, not_utf8(40)),
        (7, st.integers(129, 255).map(lambda n: b"K" * n)),  # pamqp writes 128 bytes of them
    )


def _entries(items: list[tuple[bytes, Value]]) -> Value:
    raw = table((key, value) for key, (value, _) in items)
    shown_items = "; ".join(f"{shown(key, 16)}: {what}" for key, (_, what) in items[:6])
    more = f"; ... {len(items) - 6} more" if len(items) > 6 else ""
    return raw, f"{{{shown_items}{more}}}"


def container_values(children: st.SearchStrategy[Value]) -> st.SearchStrategy[Value]:
    return st.one_of(
        st.lists(st.tuples(keys(), children), max_size=4)
        .map(_entries)
        .map(lambda value: (b"F" + value[0], "F " + value[1])),
        st.lists(children, max_size=4).map(
            lambda values: (
                b"A" + array(raw for raw, _ in values),
                "A [" + ", ".join(what for _, what in values[:6]) + "]",
            )
        ),
    )


def deep_values() -> st.SearchStrategy[Value]:
    """Tables in tables, or arrays in arrays, tens to thousands of levels deep."""

    def deep(depth: int, container: bytes, leaf: Value) -> Value:
        kind = "tables" if container == b"F" else "arrays"
        return nested(depth, leaf[0], container=container), (
            f"{kind} nested {depth} deep around {leaf[1]}"
        )

    return st.builds(
        deep,
        st.one_of(
            st.integers(2, 64),
            st.integers(250, 600),
            st.integers(900, 1200),
            st.integers(2500, 5000),
        ),
        st.sampled_from([b"F", b"A"]),
        st.sampled_from([(b"V", "V"), (b"b\x01", "b 1"), (b"S" + longstr(b"\xff"), "S b'\\xff'")]),
    )


def field_values() -> st.SearchStrategy[Value]:
    """Any field value; a long string that is not UTF-8 (which pamqp reads as ``bytes``) more
    often than the other scalars, lies seldom (the broker refuses them)."""
    return weighted(
        (60, st.recursive(scalar_values(), container_values, max_leaves=8)),
        (15, not_utf8(200).map(lambda raw: (b"S" + longstr(raw), f"S {_string(raw)}"))),
        (15, deep_values()),
        (10, lying_values()),
    )


def header_tables() -> st.SearchStrategy[Value]:
    """The ``headers`` property: a table of anything, a huge one, or one whose length lies."""

    def huge(count: int) -> Value:
        items = [(f"k{i}".encode(), b"b\x01") for i in range(count)]
        return table(items), f"a table of {count} entries"

    def lying(items: list[tuple[bytes, Value]], delta: int) -> Value:
        raw, what = _entries(items)
        claimed = max(0, len(raw) - 4 + delta)
        return U32.pack(claimed) + raw[4:], f"{what}, its length saying {claimed}"

    return weighted(
        (80, st.lists(st.tuples(keys(), field_values()), max_size=4).map(_entries)),
        (10, st.integers(200, 5000).map(huge)),
        (
            10,
            st.builds(
                lying,
                st.lists(st.tuples(keys(), scalar_values()), min_size=1, max_size=3),
                st.one_of(st.integers(-8, -1), st.integers(1, 100)),
            ),
        ),
    )


def timestamps() -> st.SearchStrategy[int]:
    """Seconds since 1970 in 64 bits, year 9999's edges (pamqp reads values past 2**32 as
    milliseconds) included."""
    return st.one_of(
        st.integers(0, 2**32 - 1),
        st.sampled_from(
            [
                0,
                2**32 - 1,
                2**32,
                253402300799,  # 9999-12-31T23:59:59 in seconds
                253402300800,
                253402300799999,  # the same in milliseconds
                253402300800000,
                2**63 - 1,
                2**63,
                2**64 - 1,
            ]
        ),
        st.integers(0, 2**64 - 1),
    )


# ---- properties and drafts ---------------------------------------------------------------------


def _short(plain: list[bytes], hostile: st.SearchStrategy[bytes] | None = None) -> Choice:
    return Choice(
        st.sampled_from(plain).map(short_value),
        (hostile if hostile is not None else short_strings()).map(short_value),
    )


def _octet(plain: list[int]) -> Choice:
    return Choice(
        st.sampled_from(plain).map(lambda n: (U8.pack(n), str(n))),
        st.integers(0, 255).map(lambda n: (U8.pack(n), str(n))),
    )


def _not_short_ttl(raw: bytes) -> bool:
    """An expiration the broker takes but that could expire the message before the worker
    gets it: its fate could not be told from a loss."""
    return not (raw.isdigit() and int(raw) < 60_000)


@dataclass(frozen=True)
class Choice:
    """The values of one property: plain ones, and hostile ones."""

    plain: st.SearchStrategy[Value]
    hostile: st.SearchStrategy[Value]
    present: float = 0.4
    """How often the property is present."""
    bad: float = 0.3
    """How often a present value is a hostile one."""


PLAIN_HEADERS = st.lists(
    st.tuples(
        st.sampled_from([b"x-app", b"x-waystation-trace-id", b"note"]),
        st.one_of(
            st.text(max_size=20).map(lambda t: (b"S" + longstr(t.encode()), f"S {t!r}")),
            _number(b"b", I8, -128, 127),
            _number(b"I", I32, -(2**31), 2**31 - 1),
        ),
    ),
    max_size=3,
).map(_entries)
CHOICES: dict[str, Choice] = {
    "content_type": _short([b"application/json", b"text/plain"]),
    "content_encoding": _short([b"gzip", b"utf-8"]),
    "headers": Choice(PLAIN_HEADERS, header_tables(), present=0.6, bad=0.5),
    "delivery_mode": _octet([1, 2]),
    "priority": _octet([0, 5, 9]),
    "correlation_id": _short([b"c-1", b"t:1:0"]),
    "reply_to": _short([b"amq.gen-nowhere", b"waystation.nobody"]),
    "expiration": _short(
        [b"600000", b"86400000", b"0060000"], short_strings().filter(_not_short_ttl)
    ),
    "message_id": replace(_short([FUZZ_ID]), present=0.9),
    "timestamp": Choice(
        st.integers(1_600_000_000, 1_900_000_000).map(lambda n: (U64.pack(n), str(n))),
        timestamps().map(lambda n: (U64.pack(n), str(n))),
    ),
    "type": replace(_short([b"task", b"task", b"cancel", b"query", b"resume"]), present=0.3),
    "user_id": replace(_short([b"guest"]), bad=0.1),  # any other is refused by the broker
    "app_id": _short([b"fuzzer"]),
    "cluster_id": _short([b"c"]),
}


def bends() -> st.SearchStrategy[Bend | None]:
    return st.one_of(
        st.just(Bend("continuation")),
        st.integers(0, 2**16 - 1).map(lambda n: Bend("continuation-word", n)),
        st.just(Bend("reserved")),
        st.integers(1, 8).map(lambda n: Bend("truncated", n)),
        st.binary(min_size=1, max_size=8).map(lambda raw: Bend("trailing", extra=raw)),
        st.sampled_from([0, 10, 20, 50, 61, 65535]).map(lambda n: Bend("class", n)),
        st.integers(1, 4).map(lambda n: Bend("body-size", n)),
    )


@st.composite
def hostile_drafts(draw: Callable[..., Any]) -> Draft:
    """A hostile message: each property present or not, each present value plain or hostile
    (so that a message holds one or two hostile values more often than ten), sometimes a bend
    of the header, and a body of any kind."""
    values = []
    for name, _, _ in PROPERTIES:
        choice = CHOICES[name]
        if draw(st.integers(0, 99)) < choice.present * 100:
            bad = draw(st.integers(0, 99)) < choice.bad * 100
            raw, what = draw(choice.hostile if bad else choice.plain)
            values.append((name, raw, what))
    body = draw(st.sampled_from((*BODIES, "runs", "runs")))
    bend = draw(bends()) if draw(st.integers(0, 99)) < 15 else None
    return Draft(tuple(values), body, bend)


def drafts(count: int, seed: int | None = None) -> list[Draft]:
    """``count`` different drafts from hypothesis (fewer if it repeats itself too often): the
    same list each time for the same ``count`` and ``seed`` (None: hypothesis's derandomized
    sequence)."""
    found: dict[Message, Draft] = {}
    if count <= 0:
        return []

    @settings(
        max_examples=2 * count,
        database=None,
        derandomize=seed is None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(hostile_drafts())
    def collect(draft: Draft) -> None:
        if len(found) < count:
            found.setdefault(draft.message("-"), draft)

    if seed is not None:
        collect = hypothesis_seed(seed)(collect)
    collect()
    return list(found.values())


# ---- the known triggers, as fixed cases --------------------------------------------------------


def _header(key: bytes, value: bytes, what: str) -> tuple[str, bytes, str]:
    return "headers", table([(key, value)]), f"{{{shown(key)}: {what}}}"


def _task(*values: tuple[str, bytes, str], body: str = "runs") -> Draft:
    """A task (its message_id the fuzz id, unless given) with these properties besides."""
    given_names = {name for name, _, _ in values}
    chosen = list(values)
    if "message_id" not in given_names:
        chosen.append(("message_id", shortstr(FUZZ_ID), "the fuzz id"))
    order = [name for name, _, _ in PROPERTIES]
    chosen.sort(key=lambda value: order.index(value[0]))
    return Draft(tuple(chosen), body)


_NOT_UTF8_S = b"S" + longstr(b"caf\xe9 \xff\xfe")
FIXED: dict[str, Draft] = {
    "message_id not UTF-8": _task(
        ("message_id", shortstr(b"id-\xff\xfe"), _string(b"id-\xff\xfe"))
    ),
    "correlation_id not UTF-8": _task(
        ("correlation_id", shortstr(b"c-\xc3\x28"), _string(b"c-\xc3\x28"))
    ),
    "header: tables nested 3,000 deep": _task(
        _header(b"deep", nested(3000, b"V"), "tables nested 3000 deep")
    ),
    "header: arrays nested 3,000 deep": _task(
        _header(b"deep", nested(3000, b"V", container=b"A"), "arrays nested 3000 deep")
    ),
    "header: long string not UTF-8, dead-lettered (invalid JSON)": _task(
        _header(b"note", _NOT_UTF8_S, "S not UTF-8"), body="invalid-json"
    ),
    "header: long string not UTF-8, retried (the handler raises once)": _task(
        _header(b"note", _NOT_UTF8_S, "S not UTF-8"), body="raises-once"
    ),
    "header: table key not UTF-8": _task(
        _header(b"k\xff\xfe", b"S" + longstr(b"v"), "S 'v' under a key not UTF-8")
    ),
    # found by the fuzzer
    "timestamp past year 9999": _task(
        ("timestamp", U64.pack(2**64 - 1), "18446744073709551615 (pamqp: year 584556019)")
    ),
    "header: timestamp past year 9999": _task(
        _header(b"when", b"T" + U64.pack(2**64 - 1), "T (timestamp) 18446744073709551615")
    ),
    "header: arrays nested 600 deep, dead-lettered (invalid JSON)": _task(
        _header(b"deep", nested(600, b"V", container=b"A"), "arrays nested 600 deep"),
        body="invalid-json",
    ),
    "flags: continuation bit without a second flag word": replace(
        _task(
            ("expiration", shortstr(b"600000"), _string(b"600000")),
            ("type", shortstr(b"task"), _string(b"task")),
            ("cluster_id", shortstr(b"c"), _string(b"c")),
        ),
        bend=Bend("continuation"),
    ),
}
"""The known triggers: a fixed message each (``scripts/fuzz`` sends them after the drawn ones).
The first seven were known; the fuzzer found the others (a timestamp pamqp cannot read, as a
property or in the headers; arrays that decode but are too deep to encode again for the dead
letter; the continuation bit, which RabbitMQ ignores and passes on, and pamqp obeys)."""
