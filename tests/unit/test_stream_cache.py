"""A worker's copies of the streams it wrote last: bounded by count and by bytes (they were
bounded by count alone, whatever the size of each stream)."""

from __future__ import annotations

import uuid

import pytest

from waystation.events import GENESIS_HASH, NewEvent, RecordedEvent, TaskState, fold
from waystation.events.chain import recorded_events
from waystation.events.codec import dumps
from waystation.runtime import streams
from waystation.runtime.streams import StreamCache


def stream(count: int, pad: int = 10, stream_id: str = "s") -> list[RecordedEvent]:
    return recorded_events(
        stream_id,
        0,
        [NewEvent(uuid.uuid4(), "Probe", {"pad": "x" * pad}, {"n": n}) for n in range(count)],
        GENESIS_HASH,
    )


def weight(events: list[RecordedEvent]) -> int:
    return sum(len(dumps(e.data)) + len(dumps(e.metadata)) for e in events)


def test_the_cache_holds_no_more_bytes_than_its_bound_evicting_the_oldest() -> None:
    cache = StreamCache(streams=100, max_bytes=10_000)
    for n in range(20):
        cache.put(f"s{n}", stream(3, pad=1000, stream_id=f"s{n}"), finished=False)
        assert cache.size[1] <= 10_000
    held, _ = cache.size
    assert 0 < held < 20
    assert cache.take("s0") is None, "the oldest went first"
    assert cache.take("s19") is not None


def test_the_cache_holds_no_more_streams_than_its_bound() -> None:
    cache = StreamCache(streams=3, max_bytes=10**9)
    for n in range(5):
        cache.put(f"s{n}", stream(1, stream_id=f"s{n}"), finished=False)
    assert cache.size[0] == 3
    assert [cache.take(f"s{n}") is not None for n in range(5)] == [False, False, True, True, True]
    assert cache.size == (0, 0)


def test_a_stream_bigger_than_the_whole_bound_is_not_kept() -> None:
    cache = StreamCache(max_bytes=500)
    cache.put("big", stream(2, pad=1000), finished=False)
    assert cache.take("big") is None and cache.size == (0, 0)


def test_a_stream_put_back_with_more_events_counts_them_all_and_a_finished_one_goes() -> None:
    cache = StreamCache()
    first = stream(4)
    cache.put("s", first[:2], finished=False)
    assert cache.size == (1, weight(first[:2]))
    taken = cache.take("s")
    assert taken is not None and cache.size == (0, 0)
    cache.put("s", [*taken, *first[2:]], finished=False)
    assert cache.size == (1, weight(first))
    cache.put("s", first, finished=True)
    assert cache.size == (0, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_copy_not_used_for_its_max_age_goes() -> None:
    """The copies of streams whose task went on elsewhere would otherwise stay until evicted."""
    clock = Clock()
    cache = StreamCache(max_age=60.0, clock=clock)
    cache.put("old", stream(2, stream_id="old"), finished=False)
    clock.now += 30
    cache.put("young", stream(2, stream_id="young"), finished=False)
    clock.now += 29.9
    assert cache.size[0] == 2
    kept = cache.take("old")
    assert kept is not None
    cache.put("old", kept, finished=False)  # put back: young again
    clock.now += 30.1  # "young" was put 60 s ago now, "old" 30.1 s ago
    assert cache.take("young") is None
    assert cache.size == (1, weight(kept))
    clock.now += 30
    cache.put("other", stream(1, stream_id="other"), finished=False)
    assert cache.size == (1, weight(stream(1, stream_id="other")))
    assert cache.take("old") is None


def test_a_max_age_of_zero_keeps_no_copy() -> None:
    cache = StreamCache(max_age=0.0, clock=Clock())
    cache.put("s", stream(2), finished=False)
    assert cache.size == (0, 0) and cache.take("s") is None


def test_a_copy_is_folded_once_whoever_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    folds: list[int] = []

    def counted(stream_id: str, events: list[RecordedEvent]) -> TaskState:
        folds.append(len(events))
        return fold(stream_id, events)

    monkeypatch.setattr(streams, "fold", counted)
    cache = StreamCache()
    copy = stream(3)
    cache.put("s", copy, finished=False)
    peeked = cache.peek("s")
    assert peeked is not None and peeked.version == 3 and cache.peek("s") is peeked
    taken = cache.take("s")
    assert taken is copy and cache.state_of("s", taken) is peeked
    assert folds == [3]  # one fold for the two peeks and the taken copy
    read = list(copy)  # the same events, read anew: folded anew
    assert cache.state_of("s", read) == peeked and folds == [3, 3]
    assert cache.peek("s") is None  # taken: nothing left to peek at


def test_copies_taken_and_never_put_back_stay_within_the_bounds() -> None:
    """The copies handed out used to be kept beside the bound, by count only (1,024 of
    any size). A decision taken elsewhere, or failed, never puts its copy back."""
    cache = StreamCache(streams=100, max_bytes=10_000)
    one = weight(stream(3, pad=1000))
    for n in range(40):
        cache.put(f"s{n}", stream(3, pad=1000, stream_id=f"s{n}"), finished=False)
        assert cache.take(f"s{n}") is not None
        assert cache.held[1] <= 10_000
    streams, held = cache.held
    assert streams == 10_000 // one and held == streams * one  # the newest ones, nothing more
    cache.put("s39", stream(4, pad=1000, stream_id="s39"), finished=False)  # one comes back
    assert cache.held[1] <= 10_000 and cache.take("s39") is not None


def test_copies_taken_and_never_put_back_age_out() -> None:
    now = [0.0]
    cache = StreamCache(max_age=60, clock=lambda: now[0])
    cache.put("s", stream(2), finished=False)
    assert cache.take("s") is not None
    now[0] = 61.0
    cache.put("t", stream(1, stream_id="t"), finished=False)
    assert cache.held[0] == 1
