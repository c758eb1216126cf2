"""Canonical JSON and the hash chain (``events/codec.py``).

``canonical`` must give the same bytes for the same JSON value whatever the key order, and the same
bytes before an insert and after PostgreSQL's ``jsonb`` gave the value back (the contract suite
checks that against the real database; here a model of ``jsonb``'s number printing checks it
across every float).
"""

from __future__ import annotations

import hashlib
import math
import random
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waystation.events import GENESIS_HASH, NewEvent, canonical, chain_hash
from waystation.events.chain import recorded_events
from waystation.events.codec import _fold
from waystation.events.model import hash_body
from waystation.events.task import _EVENT_NAMESPACE, event_id

text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=8)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
notable_floats = st.sampled_from(
    [
        0.0,
        -0.0,
        1e15,
        1e16,
        -1e16,
        2.0**53,
        2.0**60,
        2.0**63,
        -(2.0**63),
        2.0**64,
        -(2.0**64),
        1e19,
        1e20,
        1e300,
        1.7976931348623157e308,
        5e-324,
        1e-7,
        0.1,
        123456789012345.6,
        9999999999999998.0,
        7.405149907093126e17,
    ]
)
numbers = st.integers(min_value=-(2**63), max_value=2**64 - 1) | finite_floats | notable_floats
scalars = st.none() | st.booleans() | numbers | text
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(text, children, max_size=4),
    max_leaves=20,
)


def reordered(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys inserted in another order."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {key: reordered(item, rng) for key, item in items}
    if isinstance(value, list):
        return [reordered(item, rng) for item in value]
    return value


def through_jsonb(value: Any) -> Any:
    """A model of a jsonb round trip: numbers come back as ``numeric`` prints them.

    jsonb parses the number orjson wrote into a ``numeric`` and prints it in positional notation
    without an exponent (``1e+16`` → ``10000000000000000``, ``1e-7`` → ``0.0000001``,
    ``5.0`` → ``5.0``), with no negative zero; orjson then reads that text back.
    """
    if isinstance(value, float):
        written = Decimal(orjson.dumps(value).decode())
        printed = format(abs(written) if written == 0 else written, "f")
        return orjson.loads(printed)
    if isinstance(value, dict):
        return {key: through_jsonb(item) for key, item in value.items()}
    if isinstance(value, list):
        return [through_jsonb(item) for item in value]
    return value


@given(value=json_values, seed=st.integers(0, 2**32))
def test_canonical_is_stable_under_key_order(value: Any, seed: int) -> None:
    assert canonical(reordered(value, random.Random(seed))) == canonical(value)


@given(value=json_values)
def test_canonical_is_sorted_json_and_a_fixed_point(value: Any) -> None:
    encoded = canonical(value)
    decoded = orjson.loads(encoded)
    assert canonical(decoded) == encoded  # reading it back and encoding again changes nothing
    assert keys_sorted(decoded)


def keys_sorted(value: Any) -> bool:
    if isinstance(value, dict):
        return list(value) == sorted(value) and all(keys_sorted(v) for v in value.values())
    if isinstance(value, list):
        return all(keys_sorted(v) for v in value)
    return True


@given(
    value=st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | text,
        lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3),
    )
)
def test_without_floats_canonical_is_plain_sorted_json(value: Any) -> None:
    assert canonical(value) == orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


@settings(max_examples=300)
@given(value=json_values)
def test_canonical_survives_a_jsonb_round_trip(value: Any) -> None:
    assert canonical(through_jsonb(value)) == canonical(value)


def test_the_model_of_jsonb_prints_numbers_as_postgresql_does() -> None:
    # observed with SELECT '<orjson output>'::jsonb on PostgreSQL
    assert through_jsonb(1e16) == 10_000_000_000_000_000
    assert through_jsonb(2.0**60) == 1_152_921_504_606_847_000
    assert through_jsonb(-0.0) == 0 and math.copysign(1, through_jsonb(-0.0)) == 1
    assert through_jsonb(5.0) == 5.0 and isinstance(through_jsonb(5.0), float)
    assert through_jsonb(1e-7) == 1e-7


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1e16, b"10000000000000000"),
        (-1e16, b"-10000000000000000"),
        (1e19, b"10000000000000000000"),
        # jsonb prints the digits orjson wrote, not the float's exact binary value
        (2.0**60, b"1152921504606847000"),
        (7.405149907093126e17, b"740514990709312600"),
        (-0.0, b"0.0"),
        (0.0, b"0.0"),
        (0, b"0"),
        (1e15, b"1000000000000000.0"),  # below 1e16 orjson writes no exponent: left alone
        (5.0, b"5.0"),
        (True, b"true"),
        (1, b"1"),
        (
            {"b": 1, "a": [-0.0, 1e16, {"d": None, "c": 2.5}]},
            b'{"a":[0.0,10000000000000000,{"c":2.5,"d":null}],"b":1}',
        ),
    ],
)
def test_canonical_folds_numbers_the_way_jsonb_gives_them_back(value: Any, expected: bytes) -> None:
    assert canonical(value) == expected


@pytest.mark.parametrize("value", [1e20, -1e20, 2.0**64, 1e300, 1.7976931348623157e308])
def test_integral_floats_beyond_64_bits_encode_and_survive_jsonb(value: float) -> None:
    encoded = canonical(value)  # orjson cannot encode such an int; canonical must still work
    printed = format(Decimal(orjson.dumps(value).decode()), "f").encode()
    assert encoded == printed
    assert canonical(orjson.loads(printed)) == encoded  # orjson reads these digits as a float


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, -math.inf, [1, math.nan], {"a": {"b": [math.inf]}}, (math.nan,)],
)
def test_nan_and_infinity_are_rejected(value: Any) -> None:
    with pytest.raises(ValueError):
        canonical(value)
    with pytest.raises(ValueError):
        chain_hash(GENESIS_HASH, {"data": value})


def test_genesis_is_32_zero_bytes() -> None:
    assert GENESIS_HASH == bytes(32)


@given(
    prev=st.binary(min_size=32, max_size=32), body=st.dictionaries(text, json_values, max_size=5)
)
def test_chain_hash_is_sha256_of_prev_hash_and_canonical_body(
    prev: bytes, body: dict[str, Any]
) -> None:
    digest = chain_hash(prev, body)
    assert digest == hashlib.sha256(prev + canonical(body)).digest()
    assert len(digest) == 32
    assert chain_hash(prev, body) == digest


@given(
    prev=st.binary(min_size=32, max_size=32),
    other_prev=st.binary(min_size=32, max_size=32),
    body=st.dictionaries(text, json_values, max_size=5),
    other=st.dictionaries(text, json_values, max_size=5),
    seed=st.integers(0, 2**32),
)
def test_chain_hash_depends_on_the_value_and_the_link_not_on_key_order(
    prev: bytes, other_prev: bytes, body: dict[str, Any], other: dict[str, Any], seed: int
) -> None:
    digest = chain_hash(prev, body)
    assert chain_hash(prev, reordered(body, random.Random(seed))) == digest
    assert chain_hash(prev, through_jsonb(body)) == digest
    if other_prev != prev:
        assert chain_hash(other_prev, body) != digest
    if canonical(other) != canonical(body):
        assert chain_hash(prev, other) != digest


def test_a_chain_breaks_where_an_event_was_altered() -> None:
    bodies = [{"n": n, "data": {"x": n}} for n in range(5)]
    hashes = []
    prev = GENESIS_HASH
    for body in bodies:
        prev = chain_hash(prev, body)
        hashes.append(prev)
    tampered = [dict(body) for body in bodies]
    tampered[2]["data"] = {"x": 99}
    prev = GENESIS_HASH
    recomputed = []
    for body in tampered:
        prev = chain_hash(prev, body)
        recomputed.append(prev)
    assert recomputed[:2] == hashes[:2]
    assert all(a != b for a, b in zip(recomputed[2:], hashes[2:], strict=True))


new_event_fields = st.tuples(
    st.uuids(),
    text,
    st.integers(1, 99),
    st.dictionaries(text, json_values, max_size=4),
    st.dictionaries(text, json_values, max_size=4),
)
"""A ``NewEvent``'s id, type, schema version, data and metadata."""


@given(
    prev=st.binary(min_size=32, max_size=32),
    stream=text,
    version=st.integers(0, 2**31 - 10),
    events=st.lists(new_event_fields, min_size=1, max_size=3),
)
def test_an_appends_chain_is_chain_hash_over_each_events_body(
    prev: bytes, stream: str, version: int, events: list[tuple[Any, ...]]
) -> None:
    """``recorded_events`` hashes canonical pieces put together, never the whole body: it must
    give exactly ``chain_hash`` of each event's body, as written and as the log gives it back,
    whatever the strings hold (quotes, escapes, non-ASCII) and whatever the numbers are."""
    new = [
        NewEvent(event_id=i, event_type=t, data=d, metadata=m, schema_version=s)
        for i, t, s, d, m in events
    ]
    previous = prev
    for event, written in zip(recorded_events(stream, version, new, prev), new, strict=True):
        assert event.prev_hash == previous
        as_written = hash_body(
            stream,
            event.stream_version,
            written.event_id,
            written.event_type,
            written.schema_version,
            written.data,
            written.metadata,
        )
        assert event.hash == chain_hash(previous, as_written)
        assert event.hash == chain_hash(previous, event.hash_body())
        assert event.hash == chain_hash(previous, through_jsonb(event.hash_body()))
        previous = event.hash


@given(
    prev=st.binary(min_size=32, max_size=32),
    other=st.binary(min_size=32, max_size=32),
    stream=text,
    version=st.integers(0, 2**31 - 10),
    events=st.lists(new_event_fields, min_size=2, max_size=3),
)
def test_an_event_chained_again_is_made_anew_wherever_its_place_differs(
    prev: bytes, other: bytes, stream: str, version: int, events: list[tuple[Any, ...]]
) -> None:
    """A ``NewEvent`` keeps what it was last chained into and gives it back for the same
    inputs (a combined append chained part by part, then whole): anything else about its place
    (the hash before it, its version, stream, position, transaction, time) makes it anew,
    exactly as an event never chained before."""
    new = [
        NewEvent(event_id=i, event_type=t, data=d, metadata=m, schema_version=s)
        for i, t, s, d, m in events
    ]

    def fresh() -> list[NewEvent]:
        return [
            NewEvent(e.event_id, e.event_type, e.data, e.metadata, e.schema_version) for e in new
        ]

    whole = recorded_events(stream, version, fresh(), prev)
    head = recorded_events(stream, version, new[:1], prev)
    tail = recorded_events(stream, version + 1, new[1:], head[-1].hash)
    assert [*head, *tail] == whole
    assert recorded_events(stream, version, new, prev) == whole
    when = datetime(2026, 11, 24, tzinfo=UTC)
    for place in (
        {"stream_id": stream, "expected_version": version, "prev_hash": other},
        {"stream_id": stream + "x", "expected_version": version, "prev_hash": prev},
        {"stream_id": stream, "expected_version": version + 1, "prev_hash": prev},
        {"stream_id": stream, "expected_version": version, "prev_hash": prev, "tx_id": 7},
        {"stream_id": stream, "expected_version": version, "prev_hash": prev, "first_position": 3},
        {"stream_id": stream, "expected_version": version, "prev_hash": prev, "recorded_at": when},
    ):
        assert recorded_events(events=new, **place) == recorded_events(events=fresh(), **place)
    assert recorded_events(stream, version, new, prev) == whole


@given(stream=text, key=text, index=st.integers(0, 10**6))
def test_event_ids_are_the_uuid5_of_what_caused_them(stream: str, key: str, index: int) -> None:
    """Event ids are computed without ``uuid.uuid5`` (it imports on every call) but must stay
    exactly its value: a redelivery after an upgrade must find its events by the same ids."""
    expected = uuid.uuid5(_EVENT_NAMESPACE, f"{stream}\x1f{key}\x1f{index}")
    assert event_id(stream, key, index) == expected
    assert str(event_id(stream, key, index)) == str(expected)


def test_an_event_id_is_the_one_earlier_versions_wrote() -> None:
    assert str(event_id("task-1", "reply:task-1:1:0", 1)) == "b81759f3-b5c7-554f-8ab1-11892f5ffa33"


@given(value=json_values)
def test_canonical_skips_the_fold_only_where_it_would_change_nothing(value: Any) -> None:
    """``canonical`` encodes first and folds only when the encoding shows something the fold
    may change: it must give exactly what folding every value first gives."""
    try:
        folded = orjson.dumps(_fold(value), option=orjson.OPT_SORT_KEYS)
    except ValueError:  # NaN or infinity: refused either way
        with pytest.raises(ValueError):
            canonical(value)
        return
    assert canonical(value) == folded


@given(value=st.floats(min_value=1e16) | st.floats(max_value=-1e16))
def test_orjson_writes_every_float_the_fold_changes_with_a_positive_exponent(value: float) -> None:
    if math.isfinite(value):
        assert b"e+" in orjson.dumps(value)
