"""The event store contract (``events/store.py``), run against every backend.

:class:`EventStoreContract` holds the suite; each backend subclasses it and provides the ``store``
fixture. The PostgreSQL backend runs against the real database of this test run (the
``database_url`` fixture of ``tests/conftest.py``), which the whole session shares: every test uses
streams of its own (uuid4) and only ever looks at its own events and outbox rows, and deletes the
outbox rows it wrote.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace
from typing import Any

import pytest
import pytest_asyncio
import sqlalchemy.exc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from waystation.events import (
    GENESIS_HASH,
    EventStore,
    IntegrityError,
    NewEvent,
    OutboxMessage,
    Position,
    RecordedEvent,
    UnknownEvent,
    VersionConflict,
    canonical,
    chain_hash,
    parse,
)
from waystation.events.chain import chain, recorded_events
from waystation.events.codec import dumps
from waystation.events.memory import InMemoryEventStore
from waystation.events.postgres import PostgresEventStore

# ---- helpers -------------------------------------------------------------------------------------


def new_stream() -> str:
    return f"contract-{uuid.uuid4()}"


def probe(n: int, **data: Any) -> NewEvent:
    return NewEvent(
        event_id=uuid.uuid4(),
        event_type="Probe",
        data={"n": n, **data},
        metadata={"causation_id": f"cause-{n}", "worker_id": "contract"},
    )


def probes(count: int, start: int = 1) -> list[NewEvent]:
    return [probe(n) for n in range(start, start + count)]


def message(tag: str = "m") -> OutboxMessage:
    return OutboxMessage(
        message_id=f"{tag}-{uuid.uuid4()}",
        routing_key="wst-contract.nowhere",
        body=b'{"status":"ok","result":[1,2]}',
        properties={"type": "result", "correlation_id": "c", "headers": {"x-root": "r"}},
        exchange="",
    )


def verify_chain(stream_id: str, events: list[RecordedEvent]) -> None:
    """Versions 1..n in order, each hash recomputed from what was read and linked to the last."""
    previous = GENESIS_HASH
    for version, event in enumerate(events, start=1):
        assert event.stream_id == stream_id
        assert event.stream_version == version
        assert event.prev_hash == previous
        assert chain_hash(previous, event.hash_body()) == event.hash
        previous = event.hash


def same_content(recorded: RecordedEvent, sent: NewEvent) -> bool:
    return (
        recorded.event_id == sent.event_id
        and recorded.event_type == sent.event_type
        and recorded.schema_version == sent.schema_version
        and canonical(recorded.data) == canonical(sent.data)
        and canonical(recorded.metadata) == canonical(sent.metadata)
    )


async def append_new(store: EventStore, stream: str, events: list[NewEvent], **kwargs: Any) -> Any:
    """Append to the stream's head, whatever it is."""
    current = await store.read_stream(stream)
    return await store.append(
        stream,
        len(current),
        events,
        prev_hash=current[-1].hash if current else GENESIS_HASH,
        **kwargs,
    )


async def head(store: EventStore) -> Position:
    """The position after every event visible now."""
    cursor = Position()
    while batch := await store.read_all(cursor, limit=1000):
        cursor = Position.of(batch[-1])
    return cursor


async def follow(
    store: EventStore,
    after: Position,
    wanted: Iterable[uuid.UUID],
    *,
    limit: int,
    patience: float = 20,
) -> list[RecordedEvent]:
    """Page through ``read_all`` from ``after`` until every wanted event was read."""
    missing = set(wanted)
    found: list[RecordedEvent] = []
    cursor = after
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience
    while missing:
        batch = await store.read_all(cursor, limit=limit)
        assert len(batch) <= limit
        if batch:
            found.extend(batch)
            missing -= {e.event_id for e in batch}
            cursor = Position.of(batch[-1])
        else:
            assert loop.time() < deadline, f"{len(missing)} event(s) never came out of read_all"
            await asyncio.sleep(0.01)
    return found


async def claim_ids(store: EventStore, **kwargs: Any) -> dict[int, OutboxMessage]:
    return {entry.id: entry.message for entry in await store.claim_outbox(limit=10_000, **kwargs)}


# ---- the contract --------------------------------------------------------------------------------


class EventStoreContract:
    """The behaviour every backend of :class:`~waystation.events.store.EventStore` shares."""

    @pytest.fixture
    def store(self) -> EventStore:
        raise NotImplementedError("a backend's test class provides the store")

    # -- append and read_stream --

    async def test_append_then_read_stream_returns_the_events_in_order_with_a_valid_chain(
        self, store: EventStore
    ) -> None:
        stream = new_stream()
        first, second = probes(3), probes(2, start=4)
        one = await store.append(stream, 0, first, prev_hash=GENESIS_HASH)
        assert (one.version, one.duplicate, one.outbox_ids) == (3, False, ())
        two = await store.append(stream, 3, second, prev_hash=one.last_hash)
        assert (two.version, two.duplicate) == (5, False)
        events = await store.read_stream(stream)
        assert len(events) == 5
        verify_chain(stream, events)
        assert all(same_content(r, s) for r, s in zip(events, first + second, strict=True))
        assert events[2].hash == one.last_hash and events[4].hash == two.last_hash
        # the writer's own copy is what a read gives back
        assert [(e.stream_version, e.event_id, e.data, e.metadata, e.hash) for e in events] == [
            (e.stream_version, e.event_id, e.data, e.metadata, e.hash)
            for e in one.recorded + two.recorded
        ]

    async def test_a_stream_never_written_reads_empty(self, store: EventStore) -> None:
        stream = new_stream()
        assert await store.read_stream(stream) == []
        assert await store.last_event(stream) is None

    async def test_last_event_is_the_newest_event_of_its_stream_as_read_stream_gives_it(
        self, store: EventStore
    ) -> None:
        stream, other = new_stream(), new_stream()
        first = await store.append(stream, 0, probes(3), prev_hash=GENESIS_HASH)
        await store.append(other, 0, probes(2), prev_hash=GENESIS_HASH)
        last = await store.last_event(stream)
        assert last is not None
        assert (last.stream_id, last.stream_version, last.hash) == (stream, 3, first.last_hash)
        await store.append(stream, 3, probes(1, start=4), prev_hash=first.last_hash)
        newest = await store.last_event(stream)
        assert newest == (await store.read_stream(stream))[-1]
        assert newest is not None and newest.stream_version == 4

    async def test_read_stream_after_a_version_gives_the_events_that_follow_it(
        self, store: EventStore
    ) -> None:
        stream, other = new_stream(), new_stream()
        await store.append(stream, 0, probes(4), prev_hash=GENESIS_HASH)
        await store.append(other, 0, probes(3), prev_hash=GENESIS_HASH)
        whole = await store.read_stream(stream)
        assert await store.read_stream(stream, after=0) == whole
        assert await store.read_stream(stream, after=2) == whole[2:]
        assert [e.stream_version for e in whole[2:]] == [3, 4]
        assert await store.read_stream(stream, after=4) == []
        assert await store.read_stream(stream, after=9) == []
        assert await store.read_stream(new_stream(), after=1) == []

    async def test_streams_do_not_mix(self, store: EventStore) -> None:
        a, b = new_stream(), new_stream()
        await store.append(a, 0, probes(2), prev_hash=GENESIS_HASH)
        await store.append(b, 0, probes(1), prev_hash=GENESIS_HASH)
        await append_new(store, a, probes(1, start=3))
        assert [e.stream_version for e in await store.read_stream(a)] == [1, 2, 3]
        assert [e.stream_version for e in await store.read_stream(b)] == [1]
        verify_chain(a, await store.read_stream(a))
        verify_chain(b, await store.read_stream(b))

    async def test_unknown_event_types_are_kept_verbatim(self, store: EventStore) -> None:
        stream = new_stream()
        sent = NewEvent(
            uuid.uuid4(), "FromTheFuture", {"a": [1, {"b": None}]}, {}, schema_version=7
        )
        await store.append(stream, 0, [sent], prev_hash=GENESIS_HASH)
        [recorded] = await store.read_stream(stream)
        assert same_content(recorded, sent)
        assert parse(recorded) == UnknownEvent(type_name="FromTheFuture", data=sent.data)

    async def test_mutating_what_was_read_does_not_alter_the_log(self, store: EventStore) -> None:
        stream = new_stream()
        await store.append(
            stream, 0, [probe(1, items=[1, 2], nested={"k": "v"})], prev_hash=GENESIS_HASH
        )
        start = await head(store)
        [read] = await store.read_stream(stream)
        read.data["items"].append(3)
        read.data["nested"]["k"] = "changed"
        read.metadata["worker_id"] = "someone else"
        everything = await store.read_all(Position(), limit=100_000)
        [also] = [e for e in everything if e.stream_id == stream]
        also.data["n"] = 99
        [again] = await store.read_stream(stream)
        assert again.data == {"n": 1, "items": [1, 2], "nested": {"k": "v"}}
        assert again.metadata == {"causation_id": "cause-1", "worker_id": "contract"}
        verify_chain(stream, [again])
        assert await store.read_all(start) == []

    # -- optimistic concurrency and idempotence --

    async def test_a_stale_expected_version_is_a_version_conflict(self, store: EventStore) -> None:
        stream = new_stream()
        one = await store.append(stream, 0, probes(1), prev_hash=GENESIS_HASH)
        two = await store.append(stream, 1, probes(1, start=2), prev_hash=one.last_hash)
        for expected, prev_hash in ((1, one.last_hash), (0, GENESIS_HASH), (5, two.last_hash)):
            with pytest.raises(VersionConflict) as conflict:
                await store.append(stream, expected, probes(1, start=10), prev_hash=prev_hash)
            assert conflict.value.stream_id == stream
            assert conflict.value.expected_version == expected
        assert len(await store.read_stream(stream)) == 2

    async def test_appending_the_same_event_ids_again_is_a_duplicate_that_writes_nothing(
        self, store: EventStore
    ) -> None:
        stream = new_stream()
        events = probes(3)
        first = await store.append(stream, 0, events, prev_hash=GENESIS_HASH)
        before = await store.read_stream(stream)
        start = await head(store)
        size = await store.outbox_size()
        again = await store.append(
            stream, 0, events, prev_hash=GENESIS_HASH, outbox=[message()], outbox_delay=0
        )
        assert again.duplicate
        assert (again.version, again.last_hash, again.outbox_ids) == (3, first.last_hash, ())
        # still a duplicate after the stream moved on (a redelivery handled late)
        more = await store.append(stream, 3, probes(1, start=4), prev_hash=first.last_hash)
        late = await store.append(stream, 0, events, prev_hash=GENESIS_HASH)
        assert late.duplicate and (late.version, late.last_hash) == (3, first.last_hash)
        after = await store.read_stream(stream)
        assert after[:3] == before and len(after) == 4 and after[3].hash == more.last_hash
        assert await store.outbox_size() == size
        assert [e.stream_version for e in await store.read_all(start) if e.stream_id == stream] == [
            4
        ]

    async def test_a_different_event_at_an_occupied_version_is_a_version_conflict(
        self, store: EventStore
    ) -> None:
        stream = new_stream()
        one = await store.append(stream, 0, probes(2), prev_hash=GENESIS_HASH)
        with pytest.raises(VersionConflict):
            await store.append(stream, 0, probes(1, start=7), prev_hash=GENESIS_HASH)
        with pytest.raises(VersionConflict):
            await store.append(
                stream, 1, probes(2, start=7), prev_hash=(await store.read_stream(stream))[0].hash
            )
        events = await store.read_stream(stream)
        assert len(events) == 2 and events[-1].hash == one.last_hash

    async def test_an_append_whose_later_event_is_recorded_already_is_a_version_conflict(
        self, store: EventStore
    ) -> None:
        stream = new_stream()
        one = await store.append(stream, 0, probes(1), prev_hash=GENESIS_HASH)
        recorded = probe(5)
        two = await store.append(stream, 1, [recorded], prev_hash=one.last_hash)
        with pytest.raises(VersionConflict):
            await store.append(stream, 2, [probe(6), recorded], prev_hash=two.last_hash)
        events = await store.read_stream(stream)
        assert [e.stream_version for e in events] == [1, 2] and events[-1].hash == two.last_hash

    async def test_an_event_id_of_another_stream_is_an_integrity_error(
        self, store: EventStore
    ) -> None:
        a, b = new_stream(), new_stream()
        event = probe(1)
        await store.append(a, 0, [event], prev_hash=GENESIS_HASH)
        with pytest.raises(IntegrityError):
            await store.append(b, 0, [event], prev_hash=GENESIS_HASH)
        assert await store.read_stream(b) == []

    async def test_a_wrong_prev_hash_is_an_integrity_error(self, store: EventStore) -> None:
        stream = new_stream()
        one = await store.append(stream, 0, probes(2), prev_hash=GENESIS_HASH)
        for wrong in (GENESIS_HASH, bytes(31) + b"\x01", (await store.read_stream(stream))[0].hash):
            with pytest.raises(IntegrityError):
                await store.append(stream, 2, probes(1, start=3), prev_hash=wrong)
        assert (await store.read_stream(stream))[-1].hash == one.last_hash
        assert len(await store.read_stream(stream)) == 2

    async def test_a_new_stream_must_chain_to_genesis(self, store: EventStore) -> None:
        stream = new_stream()
        with pytest.raises(IntegrityError):
            await store.append(stream, 0, probes(1), prev_hash=b"\x01" * 32)
        assert await store.read_stream(stream) == []

    async def test_an_empty_append_is_an_integrity_error(self, store: EventStore) -> None:
        stream = new_stream()
        with pytest.raises(IntegrityError):
            await store.append(stream, 0, [], prev_hash=GENESIS_HASH)
        assert await store.read_stream(stream) == []

    # -- read_all --

    async def test_read_all_returns_commit_order_and_paging_gives_each_event_once(
        self, store: EventStore
    ) -> None:
        start = await head(store)
        a, b = new_stream(), new_stream()
        appends = [(a, probes(3)), (b, probes(2)), (a, probes(1, start=4)), (b, probes(4, start=3))]
        for stream, events in appends:
            await append_new(store, stream, events)
        committed = [e.event_id for _, events in appends for e in events]
        for limit in (1, 2, 3, 1000):
            pages = await follow(store, start, committed, limit=limit)
            ids = [e.event_id for e in pages]
            assert len(ids) == len(set(ids)), "an event came out twice"
            assert [i for i in ids if i in set(committed)] == committed  # commit order
            positions = [Position.of(e) for e in pages]
            assert positions == sorted(positions) and len(set(positions)) == len(positions)
            for event in pages:
                assert event.hash == next(
                    e.hash
                    for e in await store.read_stream(event.stream_id)
                    if e.event_id == event.event_id
                )
        after_all = await store.read_all(Position.of(pages[-1]))
        assert not {e.event_id for e in after_all} & set(committed)

    # -- the outbox --

    async def test_outbox_rows_wait_for_the_delay_then_are_leased_then_deleted(
        self, store: EventStore
    ) -> None:
        messages = [message("a"), message("b")]
        size = await store.outbox_size()
        result = await store.append(
            new_stream(), 0, probes(1), prev_hash=GENESIS_HASH, outbox=messages, outbox_delay=0.3
        )
        mine = set(result.outbox_ids)
        try:
            assert len(mine) == 2
            assert not mine & set(await claim_ids(store))  # the writer publishes first
            assert await store.outbox_size() == size + 2
            await asyncio.sleep(0.4)
            claimed = {i: m for i, m in (await claim_ids(store, lease=30)).items() if i in mine}
            assert sorted(claimed) == sorted(mine) == sorted(result.outbox_ids)
            assert [claimed[i] for i in sorted(claimed)] == messages  # in append order, intact
            assert not mine & set(await claim_ids(store, lease=30))  # leased: not again
            await store.delete_outbox(list(mine))
            assert await store.outbox_size() == size
            assert not mine & set(await claim_ids(store))
        finally:
            await store.delete_outbox(list(mine))

    async def test_a_row_whose_message_waits_a_delay_is_claimable_only_after_it(
        self, store: EventStore
    ) -> None:
        """A message with a ``delay`` (a retry's backoff) is published by its writer to wait in
        the broker; its row reaches a relay no sooner, and then with its delay spent."""
        later, much_later = message("later"), message("much later")
        result = await store.append(
            new_stream(),
            0,
            probes(1),
            prev_hash=GENESIS_HASH,
            outbox=[replace(later, delay=0.3), replace(much_later, delay=3600)],
            outbox_delay=0,
        )
        soon, never = result.outbox_ids
        try:
            claimed: dict[int, OutboxMessage] = {}
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while soon not in claimed:
                assert loop.time() < deadline, "the row never became claimable"
                claimed.update(await claim_ids(store, lease=30))
                await asyncio.sleep(0.05)
            assert claimed[soon] == later  # its delay spent: published at once now
            assert never not in claimed
        finally:
            await store.delete_outbox([soon, never])

    async def test_a_row_given_back_is_claimable_after_its_delay_counting_its_refusals(
        self, store: EventStore
    ) -> None:
        result = await store.append(
            new_stream(), 0, probes(1), prev_hash=GENESIS_HASH, outbox=[message()], outbox_delay=0
        )
        (mine,) = result.outbox_ids
        try:
            (entry,) = [e for e in await store.claim_outbox(limit=10_000) if e.id == mine]
            assert (entry.refusals, 0 <= entry.age < 60) == (0, True)
            await store.retry_outbox([mine], 0, refused="a full queue")
            await store.retry_outbox([mine], 0, refused="a full queue")
            await store.retry_outbox([mine], 0)  # given back without a refusal: not counted
            (entry,) = [e for e in await store.claim_outbox(limit=10_000) if e.id == mine]
            assert entry.refusals == 2
            await store.retry_outbox([mine], 3600, refused="again")
            assert mine not in await claim_ids(store)  # not before its delay
            await store.retry_outbox([], 0)
        finally:
            await store.delete_outbox([mine])

    async def test_a_rows_message_can_be_replaced_keeping_its_refusals(
        self, store: EventStore
    ) -> None:
        result = await store.append(
            new_stream(), 0, probes(1), prev_hash=GENESIS_HASH, outbox=[message()], outbox_delay=0
        )
        (mine,) = result.outbox_ids
        instead = message("instead")
        try:
            await store.retry_outbox([mine], 0, refused="full")
            await store.replace_outbox(mine, instead)
            (entry,) = [e for e in await store.claim_outbox(limit=10_000) if e.id == mine]
            assert entry.message == instead and entry.refusals == 1
        finally:
            await store.delete_outbox([mine])

    async def test_outbox_oldest_is_at_least_the_age_of_a_row_not_yet_deleted(
        self, store: EventStore
    ) -> None:
        deployment = f"d-{uuid.uuid4()}."
        result = await store.append(
            new_stream(),
            0,
            [NewEvent(uuid.uuid4(), "Probe", {}, {"deployment": deployment})],
            prev_hash=GENESIS_HASH,
            outbox=[message()],
            outbox_delay=0,
        )
        (mine,) = result.outbox_ids
        try:
            await asyncio.sleep(0.2)
            (entry,) = [
                e
                for e in await store.claim_outbox(limit=10_000, deployment=deployment)
                if e.id == mine
            ]
            oldest = await store.outbox_oldest(deployment=deployment)
            assert entry.age >= 0.1  # (rows of no deployment may be older still)
            assert oldest is not None and oldest >= entry.age - 0.05
        finally:
            await store.delete_outbox([mine])

    async def test_an_expired_lease_makes_a_row_claimable_again(self, store: EventStore) -> None:
        result = await store.append(
            new_stream(), 0, probes(1), prev_hash=GENESIS_HASH, outbox=[message()], outbox_delay=0
        )
        mine = set(result.outbox_ids)
        try:
            assert mine <= set(await claim_ids(store, lease=0.2))
            assert not mine & set(await claim_ids(store, lease=0.2))
            await asyncio.sleep(0.3)
            assert mine <= set(await claim_ids(store, lease=30))
        finally:
            await store.delete_outbox(list(mine))

    async def test_claim_outbox_honours_its_limit_oldest_first(self, store: EventStore) -> None:
        result = await store.append(
            new_stream(),
            0,
            probes(1),
            prev_hash=GENESIS_HASH,
            outbox=[message() for _ in range(3)],
            outbox_delay=0,
        )
        mine = set(result.outbox_ids)
        try:
            # other tests' leftover rows may be claimable too (the database is the run's), but
            # at least these three are: a limit of 2 takes exactly 2, the oldest first
            entries = await store.claim_outbox(limit=2, lease=30)
            rest = await store.claim_outbox(limit=10_000, lease=30)
            first = [e.id for e in entries]
            later = {e.id for e in rest}
            assert len(first) == 2 and first == sorted(first)
            assert not set(first) & later
            assert mine <= set(first) | later, "every claimable row of ours was claimed"
            assert max(first) < min(later & mine), "a newer row claimed before an older one"
        finally:
            await store.delete_outbox(list(mine))
        assert await store.delete_outbox([]) is None

    async def test_a_relay_of_one_deployment_claims_only_that_deployments_outbox_rows(
        self, store: EventStore
    ) -> None:
        ours, theirs = f"ours-{uuid.uuid4()}.", f"theirs-{uuid.uuid4()}."
        sizes = {d: await store.outbox_size(deployment=d) for d in (ours, theirs)}
        rows: dict[str, set[int]] = {}
        for deployment in (ours, theirs):
            result = await store.append(
                new_stream(),
                0,
                [NewEvent(uuid.uuid4(), "Probe", {}, {"deployment": deployment})],
                prev_hash=GENESIS_HASH,
                outbox=[message(deployment), message(deployment)],
                outbox_delay=0,
            )
            rows[deployment] = set(result.outbox_ids)
        everything = rows[ours] | rows[theirs]
        try:
            assert {d: await store.outbox_size(deployment=d) for d in (ours, theirs)} == {
                ours: sizes[ours] + 2,
                theirs: sizes[theirs] + 2,
            }
            assert everything & set(await claim_ids(store, deployment=ours, lease=30)) == rows[ours]
            assert everything & set(await claim_ids(store, deployment=ours, lease=30)) == set()
            claimed = await claim_ids(store, deployment=theirs, lease=30)
            assert everything & set(claimed) == rows[theirs]
            assert all(claimed[i].message_id.startswith(theirs) for i in rows[theirs])
        finally:
            await store.delete_outbox(list(everything))
        assert {d: await store.outbox_size(deployment=d) for d in (ours, theirs)} == sizes

    async def test_outbox_rows_of_no_deployment_are_claimed_by_any_relay(
        self, store: EventStore
    ) -> None:
        """Rows whose events name no deployment (as every row written before the outbox knew
        deployments) go to whichever relay comes first, as they always did."""
        relays = (f"one-{uuid.uuid4()}.", f"another-{uuid.uuid4()}.", None)
        sizes = [await store.outbox_size(deployment=d) for d in relays]
        result = await store.append(
            new_stream(), 0, probes(1), prev_hash=GENESIS_HASH, outbox=[message()], outbox_delay=0
        )
        mine = set(result.outbox_ids)
        try:
            assert [await store.outbox_size(deployment=d) for d in relays] == [
                size + 1 for size in sizes
            ]
            for deployment in relays:
                # a lease of 0 s hands the row straight back for the next relay to try
                assert mine <= set(await claim_ids(store, deployment=deployment, lease=0))
        finally:
            await store.delete_outbox(list(mine))

    async def test_an_append_that_fails_writes_no_outbox_rows(self, store: EventStore) -> None:
        stream = new_stream()
        one = await store.append(stream, 0, probes(1), prev_hash=GENESIS_HASH)
        size = await store.outbox_size()
        sent = [message("lost"), message("lost")]
        with pytest.raises(VersionConflict):
            await store.append(
                stream, 0, probes(1, start=2), prev_hash=GENESIS_HASH, outbox=sent, outbox_delay=0
            )
        with pytest.raises(VersionConflict):
            await store.append(
                stream, 3, probes(1, start=2), prev_hash=one.last_hash, outbox=sent, outbox_delay=0
            )
        with pytest.raises(IntegrityError):
            await store.append(
                stream, 1, probes(1, start=2), prev_hash=GENESIS_HASH, outbox=sent, outbox_delay=0
            )
        assert await store.outbox_size() == size
        claimed = await store.claim_outbox(limit=10_000, lease=0.01)
        assert not {m.message_id for m in sent} & {e.message.message_id for e in claimed}
        assert len(await store.read_stream(stream)) == 1


class TestInMemoryEventStore(EventStoreContract):
    @pytest.fixture
    def store(self) -> EventStore:
        return InMemoryEventStore()

    async def test_global_order_is_the_order_of_appends(self) -> None:
        store = InMemoryEventStore()
        a, b = new_stream(), new_stream()
        await store.append(a, 0, probes(2), prev_hash=GENESIS_HASH)
        await store.append(b, 0, probes(1), prev_hash=GENESIS_HASH)
        events = await store.read_all()
        assert [(e.stream_id, e.global_position, e.tx_id) for e in events] == [
            (a, 1, 1),
            (a, 2, 1),
            (b, 3, 2),
        ]


# ---- PostgreSQL ----------------------------------------------------------------------------------

text_without_nul = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\x00"), max_size=10
)
jsonb_numbers = (
    st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(
        [
            0.0,
            -0.0,
            5.0,
            1e15,
            1e16,
            -1e16,
            2.0**60,
            7.405149907093126e17,
            1e19,
            1e20,
            -1e22,
            2.0**64,
            1e300,
            1.7976931348623157e308,
            5e-324,
            1e-7,
            0.1,
        ]
    )
)
jsonb_values = st.recursive(
    st.none() | st.booleans() | jsonb_numbers | text_without_nul,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(text_without_nul, children, max_size=4)
    ),
    max_leaves=20,
)


class TestPostgresEventStore(EventStoreContract):
    @pytest_asyncio.fixture
    async def store(self, database_url: str) -> AsyncIterator[EventStore]:
        store = PostgresEventStore.from_url(database_url, pool_size=10)
        yield store
        await store.close()

    @pytest_asyncio.fixture
    async def transactional(self, database_url: str) -> AsyncIterator[AsyncEngine]:
        """An engine with real transactions (the store's own runs in autocommit)."""
        engine = create_async_engine(database_url)
        yield engine
        await engine.dispose()

    @pytest.mark.parametrize(
        "statement",
        [
            "UPDATE events SET data = CAST('{}' AS jsonb) WHERE stream_id = :stream",
            "UPDATE events SET hash = prev_hash WHERE stream_id = :stream",
            "DELETE FROM events WHERE stream_id = :stream",
            "TRUNCATE events",
        ],
    )
    async def test_the_database_rejects_changes_to_the_log(
        self, store: PostgresEventStore, transactional: AsyncEngine, statement: str
    ) -> None:
        stream = new_stream()
        await store.append(stream, 0, probes(2), prev_hash=GENESIS_HASH)
        before = await store.read_stream(stream)
        # in a transaction that is rolled back whatever happens: a missing trigger must not be
        # able to wipe the log the rest of the session shares
        async with transactional.connect() as connection:
            transaction = await connection.begin()
            try:
                with pytest.raises(sqlalchemy.exc.DBAPIError, match="append-only"):
                    await connection.execute(text(statement), {"stream": stream})
            finally:
                await transaction.rollback()
        after = await store.read_stream(stream)
        assert after == before
        verify_chain(stream, after)

    @settings(
        max_examples=50,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        data=jsonb_values,
        metadata=st.dictionaries(text_without_nul, jsonb_values, max_size=3),
        second=jsonb_values,
    )
    # beyond 64 bits: jsonb gives the digits back, which a float parse reads as a float again
    @example(data=None, metadata={}, second=1.8446744073709552e19)
    @example(data=-0.0, metadata={"t": 1e16}, second=[1e-7, -1e300])
    async def test_hashes_recomputed_from_what_jsonb_gives_back_match(
        self, store: PostgresEventStore, data: Any, metadata: dict[str, Any], second: Any
    ) -> None:
        stream = new_stream()
        sent = [
            NewEvent(uuid.uuid4(), "Probe", {"value": data}, metadata),
            NewEvent(uuid.uuid4(), "Probe", {"value": second, "list": [data, second]}, {}),
        ]
        result = await store.append(stream, 0, sent, prev_hash=GENESIS_HASH)
        events = await store.read_stream(stream)
        verify_chain(stream, events)
        assert events[-1].hash == result.last_hash
        assert all(same_content(r, s) for r, s in zip(events, sent, strict=True))
        # a writer's own copy of what it appended (the worker's stream cache) is what a read
        # gives back, value for value: -0.0, 1e16 and the like come back as jsonb has them
        own = result.recorded
        assert own == tuple(recorded_events(stream, 0, sent, GENESIS_HASH))
        assert [
            (e.stream_version, e.event_id, e.data, e.metadata, e.prev_hash, e.hash) for e in own
        ] == [
            (e.stream_version, e.event_id, e.data, e.metadata, e.prev_hash, e.hash) for e in events
        ]
        # == cannot tell 1e16 from 10**16: compare the encodings too (keys sorted, as order
        # in a jsonb object is not the one written)
        assert [dumps(e.data) for e in own] == [dumps(e.data) for e in events]
        assert [dumps(e.metadata) for e in own] == [dumps(e.metadata) for e in events]

    async def test_a_reader_following_read_all_sees_every_event_of_concurrent_writers_once(
        self, store: PostgresEventStore, transactional: AsyncEngine
    ) -> None:
        """The snapshot-horizon cursor under 8 concurrent writers and one slow transaction.

        The slow transaction takes a global position, then stays open while the writers commit
        events at later positions. A cursor on ``global_position`` alone would move past it and
        never see it; ``read_all`` must hold back everything from the slow transaction on until it
        commits, then deliver every event exactly once.
        """
        start = await head(store)
        writers, appends_each = 8, 25
        streams = [new_stream() for _ in range(writers)]
        expected: set[uuid.UUID] = set()
        appended = 0
        reached = {20: asyncio.Event(), 120: asyncio.Event()}  # appends so far
        slow_state = "pending"
        slow_tx = 0
        appended_while_slow_open = 0

        async def write(stream: str) -> None:
            nonlocal appended, appended_while_slow_open
            version, last_hash = 0, GENESIS_HASH
            for n in range(appends_each):
                events = probes(1 + n % 3, start=version + 1)
                expected.update(e.event_id for e in events)
                began_while_open = slow_state == "open"
                result = await store.append(stream, version, events, prev_hash=last_hash)
                if began_while_open and slow_state == "open":
                    appended_while_slow_open += 1
                version, last_hash = result.version, result.last_hash
                appended += 1
                for count, event in reached.items():
                    if appended >= count:
                        event.set()
                await asyncio.sleep(0)

        async def slow_transaction() -> None:
            nonlocal slow_state, slow_tx
            stream = new_stream()
            event = probe(0)
            expected.add(event.event_id)
            [(version, previous, digest)] = chain(stream, 0, [event], GENESIS_HASH)
            await reached[20].wait()
            async with transactional.connect() as connection:
                transaction = await connection.begin()
                row = (
                    await connection.execute(
                        text(
                            """
                            INSERT INTO events (stream_id, stream_version, event_id, event_type,
                                                schema_version, data, metadata, prev_hash, hash)
                            VALUES (:stream, :version, :event_id, :event_type, 1,
                                    CAST(:data AS jsonb), CAST(:metadata AS jsonb), :prev, :hash)
                            RETURNING tx_id::text
                            """
                        ),
                        {
                            "stream": stream,
                            "version": version,
                            "event_id": event.event_id,
                            "event_type": event.event_type,
                            "data": dumps(event.data).decode(),
                            "metadata": dumps(event.metadata).decode(),
                            "prev": previous,
                            "hash": digest,
                        },
                    )
                ).one()
                slow_tx, slow_state = int(row[0]), "open"
                await reached[120].wait()
                slow_state = "committing"
                await transaction.commit()
            slow_state = "committed"

        seen: list[RecordedEvent] = []

        async def read() -> None:
            cursor = start
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while (
                slow_state != "committed"
                or appended < writers * appends_each
                or not (expected <= {e.event_id for e in seen})
            ):
                assert loop.time() < deadline, "the reader never caught up"
                open_before = slow_state == "open"
                batch = await store.read_all(cursor, limit=7)
                if open_before and slow_state == "open":
                    # read entirely while the slow transaction was open: nothing from it on
                    assert all(e.tx_id < slow_tx for e in batch)
                if batch:
                    seen.extend(batch)
                    cursor = Position.of(batch[-1])
                else:
                    await asyncio.sleep(0.002)

        await asyncio.gather(read(), slow_transaction(), *(write(s) for s in streams))
        assert appended_while_slow_open > 0, "no writer committed past the open slow transaction"
        counts = collections.Counter(e.event_id for e in seen)
        assert [i for i, c in counts.items() if c > 1] == []
        assert expected <= set(counts)
        positions = [Position.of(e) for e in seen]
        assert positions == sorted(positions)
        for stream in streams:
            assert [e.stream_version for e in seen if e.stream_id == stream] == list(
                range(1, len(await store.read_stream(stream)) + 1)
            )
