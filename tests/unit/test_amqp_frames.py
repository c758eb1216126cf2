"""The faster codec of the hot path's AMQP frames (``waystation.brokers.amqp.frames``) gives what
pamqp gives: the same bytes for every frame it encodes, equal objects (or the same error) for every
frame it decodes, well formed or not. The broker contract tests (tests/contract/test_broker.py)
run it against RabbitMQ."""

from __future__ import annotations

import datetime
import functools
import re
from typing import Any

import pamqp.body
import pamqp.commands
import pamqp.frame
import pamqp.header
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from waystation.brokers.amqp import frames

pytestmark = pytest.mark.timeout(300)

Basic = pamqp.commands.Basic
PAMQP_MARSHAL = frames._pamqp_marshal
PAMQP_UNMARSHAL = frames._pamqp_unmarshal
EXAMPLES = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- what frames hold ----------------------------------------------------------------------

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.:@#,/+ ", max_size=40)
texts = st.one_of(
    st.text(max_size=30),
    names,
    st.text(min_size=120, max_size=300),  # around the short string's 255 bytes
    st.just(""),
)
BOUNDS = [2**63, 2**32, 2**31, 65536, 32768, 256, 128]
integers = st.one_of(
    st.sampled_from(
        [n + d for n in BOUNDS for d in (-1, 0)] + [-n + d for n in BOUNDS for d in (-1, 0)]
    ),
    st.integers(-130, 130),
    st.integers(-(2**31) - 5, 2**32 + 5),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(2**63, 2**64),  # beyond every AMQP integer
)
scalars = st.one_of(
    texts,
    integers,
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, width=32),
    st.datetimes(
        min_value=datetime.datetime(2000, 1, 1), max_value=datetime.datetime(2100, 1, 1)
    ).map(lambda moment: moment.replace(microsecond=0, tzinfo=datetime.UTC)),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
keys = st.one_of(st.text(max_size=12), st.text(alphabet="ké", min_size=60, max_size=132))
headers = st.one_of(
    st.none(),
    st.dictionaries(keys, st.one_of(texts, integers)),
    st.dictionaries(keys, values, max_size=5),
)


@st.composite
def properties(draw: st.DrawFn) -> Any:
    maybe = lambda strategy: draw(st.one_of(st.none(), strategy))  # noqa: E731
    return Basic.Properties(
        content_type=maybe(texts),
        content_encoding=maybe(texts),
        headers=draw(headers),
        delivery_mode=maybe(st.sampled_from([1, 2])),
        priority=maybe(st.integers(0, 255)),
        correlation_id=maybe(texts),
        reply_to=maybe(texts),
        expiration=maybe(texts),
        message_id=maybe(texts),
        timestamp=maybe(
            st.datetimes(
                min_value=datetime.datetime(2000, 1, 1), max_value=datetime.datetime(2100, 1, 1)
            ).map(lambda moment: moment.replace(microsecond=0, tzinfo=datetime.UTC))
        ),
        message_type=maybe(texts),
        user_id=maybe(texts),
        app_id=maybe(texts),
    )


channels = st.integers(0, 65535)


@st.composite
def any_frame(draw: st.DrawFn) -> Any:
    """A frame of every kind the codec takes, and some it leaves to pamqp."""
    tags = st.integers(0, 2**63 - 1)
    kind = draw(st.sampled_from(range(9)))
    if kind == 0:
        publish = Basic.Publish(
            routing_key=draw(texts), mandatory=draw(st.booleans()), immediate=draw(st.booleans())
        )
        # set after: the constructor refuses a name pamqp's encoder refuses too
        publish.exchange = draw(st.one_of(names, st.text(max_size=130)))
        return publish
    if kind == 1:
        return pamqp.header.ContentHeader(
            body_size=draw(st.integers(0, 2**64 - 1)), properties=draw(properties())
        )
    if kind == 2:
        return pamqp.body.ContentBody(draw(st.binary(max_size=300)))
    if kind == 3:
        return Basic.Ack(delivery_tag=draw(tags), multiple=draw(st.booleans()))
    if kind == 4:
        return Basic.Nack(
            delivery_tag=draw(tags), multiple=draw(st.booleans()), requeue=draw(st.booleans())
        )
    if kind == 5:
        return Basic.Deliver(
            consumer_tag=draw(texts.filter(lambda text: len(text.encode()) <= 255)),
            delivery_tag=draw(tags),
            redelivered=draw(st.booleans()),
            exchange=draw(names),
            routing_key=draw(texts.filter(lambda text: len(text.encode()) <= 255)),
        )
    if kind == 6:
        return Basic.Return(
            reply_code=312, reply_text="NO_ROUTE", exchange=draw(names), routing_key=draw(names)
        )
    if kind == 7:
        return pamqp.commands.Channel.OpenOk()
    return Basic.QosOk()


def described(frame: Any) -> Any:
    """Everything a frame object holds, to compare two of them."""
    if isinstance(frame, pamqp.header.ContentHeader):
        return (
            "header",
            frame.class_id,
            frame.weight,
            frame.body_size,
            described(frame.properties),
        )
    if isinstance(frame, pamqp.body.ContentBody):
        return ("body", frame.value)
    slots = getattr(type(frame), "__slots__", ())
    return (type(frame), tuple((name, typed(getattr(frame, name, None))) for name in slots))


def typed(value: Any) -> Any:
    """``value`` with the type of everything in it (True and 1 are equal, but not the same)."""
    if isinstance(value, dict):
        return {key: typed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [typed(item) for item in value]
    return (type(value), value)


def outcome(function: Any, *args: Any) -> Any:
    """What ``function`` returns, or the type and text of what it raises."""
    try:
        return ("returned", function(*args))
    except Exception as error:  # (a frame object in the text is named, not placed)
        return ("raised", type(error), re.sub(" at 0x[0-9a-f]+", "", str(error)))


def decoded(function: Any, data: bytes) -> Any:
    result = outcome(function, data)
    if result[0] == "returned":
        consumed, channel, frame = result[1]
        return ("returned", consumed, channel, described(frame))
    return result


# ---- encoding ------------------------------------------------------------------------------


@EXAMPLES
@given(any_frame(), channels)
def test_every_frame_is_encoded_as_pamqp_encodes_it(frame: Any, channel: int) -> None:
    assert outcome(frames.marshal, frame, channel) == outcome(PAMQP_MARSHAL, frame, channel)


def test_the_publish_of_a_worker_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The frames of the publishes and acks a worker makes never reach pamqp's encoder."""

    def refused(frame: Any, channel: int) -> bytes:
        raise AssertionError(f"{type(frame).__name__} went to pamqp")

    monkeypatch.setattr(frames, "_pamqp_marshal", refused)
    body = b'{"topic": "x"}'
    message = [
        Basic.Publish(exchange="", routing_key="wst.tasks.researcher", mandatory=True),
        pamqp.header.ContentHeader(
            body_size=len(body),
            properties=Basic.Properties(
                message_id="7f0c6a9e:1:0",
                correlation_id="7f0c6a9e:1:0",
                reply_to="wst.replies.orchestrator",
                message_type="task",
                content_type="application/json",
                headers={"x-root": "7f0c6a9e", "x-attempts": 2, "x-big": 70000},
                delivery_mode=2,
            ),
        ),
        pamqp.body.ContentBody(body),
        Basic.Ack(delivery_tag=41),
    ]
    monkeypatch.setattr(frames, "_pamqp_marshal", PAMQP_MARSHAL)
    expected = [PAMQP_MARSHAL(frame, 3) for frame in message]
    monkeypatch.setattr(frames, "_pamqp_marshal", refused)
    assert [frames.marshal(frame, 3) for frame in message] == expected


@EXAMPLES
@given(st.dictionaries(keys, st.one_of(integers, st.booleans()), min_size=1), channels)
def test_headers_of_numbers_go_both_ways_as_in_pamqp(table: dict[str, Any], channel: int) -> None:
    header = pamqp.header.ContentHeader(body_size=1, properties=Basic.Properties(headers=table))
    written = outcome(frames.marshal, header, channel)
    assert written == outcome(PAMQP_MARSHAL, header, channel)
    if written[0] == "returned":
        assert decoded(frames.unmarshal, written[1]) == decoded(PAMQP_UNMARSHAL, written[1])


def test_integers_at_every_bound_go_both_ways_as_in_pamqp() -> None:
    bounds = [sign * n + d for n in BOUNDS for sign in (1, -1) for d in (-1, 0, 1)]
    for number in [*bounds, True, False]:
        test_headers_of_numbers_go_both_ways_as_in_pamqp.hypothesis.inner_test({"n": number}, 1)


def test_short_strings_at_their_limit_are_encoded_as_pamqp_encodes_them() -> None:
    """255 bytes fit a short string; 256 do not (pamqp refuses them), in characters of one byte
    or several."""
    for text in ["k" * 254, "k" * 255, "k" * 256, "é" * 127 + "k", "é" * 128]:
        frames_of_it = [
            Basic.Publish(routing_key=text),
            pamqp.header.ContentHeader(body_size=0, properties=Basic.Properties(reply_to=text)),
        ]
        for frame in frames_of_it:
            assert outcome(frames.marshal, frame, 1) == outcome(PAMQP_MARSHAL, frame, 1)


# ---- decoding ------------------------------------------------------------------------------


@EXAMPLES
@given(any_frame(), channels)
def test_every_frame_is_decoded_as_pamqp_decodes_it(frame: Any, channel: int) -> None:
    try:
        data = PAMQP_MARSHAL(frame, channel)
    except Exception:
        assume(False)  # not a frame pamqp can write: nothing to read
    assert decoded(frames.unmarshal, data) == decoded(PAMQP_UNMARSHAL, data)


@EXAMPLES
@given(any_frame(), channels, st.data())
def test_a_damaged_or_partial_frame_is_read_as_pamqp_reads_it(
    frame: Any, channel: int, data: st.DataObject
) -> None:
    try:
        whole = PAMQP_MARSHAL(frame, channel)
    except Exception:
        assume(False)
    damage = data.draw(st.sampled_from(["cut", "flip", "extend", "size"]))
    damaged = bytearray(whole)
    if damage == "cut":
        damaged = damaged[: data.draw(st.integers(0, len(whole) - 1))]
    elif damage == "flip":
        at = data.draw(st.integers(0, len(whole) - 1))
        damaged[at] = data.draw(st.integers(0, 255))
    elif damage == "extend":
        damaged += data.draw(st.binary(min_size=1, max_size=20))
    else:  # a length inside the frame off by a little
        at = data.draw(st.integers(0, len(whole) - 1))
        damaged[at] = (damaged[at] + data.draw(st.sampled_from([1, 2, 255]))) % 256
    assert decoded(frames.unmarshal, bytes(damaged)) == decoded(PAMQP_UNMARSHAL, bytes(damaged))


def test_the_frames_of_a_delivery_and_a_confirm_take_the_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = b'{"ok": true}'
    incoming = [
        Basic.Deliver(
            consumer_tag="ctag-1", delivery_tag=9, exchange="", routing_key="wst.tasks.a"
        ),
        pamqp.header.ContentHeader(
            body_size=len(body),
            properties=Basic.Properties(
                message_id="m",
                headers={"x-root": "r", "x-delivery-count": 1, "nested": {"a": [1, "b", None]}},
                delivery_mode=2,
            ),
        ),
        pamqp.body.ContentBody(body),
        Basic.Ack(delivery_tag=12, multiple=True),
        Basic.Nack(delivery_tag=13, requeue=False),
    ]
    data = [PAMQP_MARSHAL(frame, 1) for frame in incoming]
    expected = [decoded(PAMQP_UNMARSHAL, raw) for raw in data]

    def refused(raw: bytes) -> Any:
        raise AssertionError("went to pamqp")

    monkeypatch.setattr(frames, "_pamqp_unmarshal", refused)
    assert [decoded(frames.unmarshal, raw) for raw in data] == expected


def test_a_string_that_is_not_utf8_comes_back_as_bytes_as_pamqp_gives_it() -> None:
    table = b"\x01kS\x00\x00\x00\x02\xff\xfe"
    payload = b"\x00\x3c\x00\x00" + (5).to_bytes(8, "big") + b"\x20\x00"
    payload += len(table).to_bytes(4, "big") + table
    data = b"\x02\x00\x01" + len(payload).to_bytes(4, "big") + payload + b"\xce"
    assert decoded(frames.unmarshal, data) == decoded(PAMQP_UNMARSHAL, data)
    assert frames.unmarshal(data)[2].properties.headers == {"k": b"\xff\xfe"}


# ---- installing ----------------------------------------------------------------------------


def test_install_puts_a_dispatcher_in_pamqps_place_that_is_pamqp_outside_a_scope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pamqp.frame, "marshal", PAMQP_MARSHAL)
    monkeypatch.setattr(pamqp.frame, "unmarshal", PAMQP_UNMARSHAL)
    assert not frames.installed()
    assert frames.install()
    assert frames.installed()
    assert frames.install()  # again: nothing changes
    codec: list[str] = []
    monkeypatch.setattr(frames, "marshal", lambda *a: codec.append("marshal") or PAMQP_MARSHAL(*a))
    monkeypatch.setattr(
        frames, "unmarshal", lambda *a: codec.append("unmarshal") or PAMQP_UNMARSHAL(*a)
    )
    ack = Basic.Ack(delivery_tag=7)
    written = pamqp.frame.marshal(ack, 1)
    assert pamqp.frame.unmarshal(written)[2].delivery_tag == 7
    assert codec == []  # outside a scope: pamqp's own, for any other connection
    with frames.scope():
        assert frames.ours()
        assert pamqp.frame.marshal(ack, 1) == written
        pamqp.frame.unmarshal(written)
        with frames.scope(False):
            pamqp.frame.marshal(ack, 1)
    assert codec == ["marshal", "unmarshal"]
    assert not frames.ours()
    assert frames.context().run(frames.ours) and not frames.context(False).run(frames.ours)


def test_a_pamqp_with_another_layout_keeps_its_own_codec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pamqp.frame, "marshal", PAMQP_MARSHAL)
    monkeypatch.setattr(pamqp.frame, "unmarshal", PAMQP_UNMARSHAL)
    monkeypatch.setattr(Basic.Properties, "flags", {**Basic.Properties.flags, "priority": 0x1})
    assert not frames.install()
    assert pamqp.frame.marshal is PAMQP_MARSHAL and pamqp.frame.unmarshal is PAMQP_UNMARSHAL
    assert not frames.installed()


def test_the_dispatcher_guards_the_content_headers_of_waystations_own_frames_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A content header that does not decode (a ``message_id`` that is not UTF-8) fails pamqp's
    decode, which ends a connection's reader; read as Waystation's own frames, guarded or coded
    here, it decodes to what the guard salvaged, saying what was wrong. Outside, pamqp's error."""
    monkeypatch.setattr(pamqp.frame, "marshal", PAMQP_MARSHAL)
    monkeypatch.setattr(pamqp.frame, "unmarshal", PAMQP_UNMARSHAL)
    assert frames.install()
    good = PAMQP_MARSHAL(
        pamqp.header.ContentHeader(0, 5, Basic.Properties(message_id="m-1", headers={"k": 1})), 3
    )
    bad = good.replace(b"m-1", b"m\xff1")
    for on, guarded in ((True, False), (False, True)):
        read = frames.context(on, guarded=guarded).run
        assert decoded(functools.partial(read, pamqp.frame.unmarshal), good) == decoded(
            PAMQP_UNMARSHAL, good
        )
        size, channel, header = read(pamqp.frame.unmarshal, bad)
        assert (size, channel, header.body_size) == (len(bad), 3, 5)
        assert header.properties.message_id is None
        assert header.properties.headers["k"] == 1
        assert "message_id: not UTF-8" in header.properties.headers["x-waystation-undecodable"]
    with pytest.raises(Exception, match="ContentHeader"):
        frames.context(False).run(pamqp.frame.unmarshal, bad)
