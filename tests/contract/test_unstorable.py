"""What the log cannot store is refused the same way by every backend: ``IntegrityError`` (a
caller's mistake, never a transient failure to retry)."""

from __future__ import annotations

import base64
import random
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from waystation.events import GENESIS_HASH, EventStore, IntegrityError, NewEvent
from waystation.events.memory import InMemoryEventStore
from waystation.events.postgres import PostgresEventStore


def event(data: dict[str, object]) -> NewEvent:
    return NewEvent(uuid.uuid4(), "Probe", data, {"worker_id": "contract"})


class UnstorableContract:
    @pytest.fixture
    def store(self) -> EventStore:
        raise NotImplementedError

    @pytest.mark.parametrize(
        "data",
        [{"text": "a\x00b"}, {"a\x00": 1}, {"nested": [{"deep": "\x00"}]}],
        ids=["NUL in a value", "NUL in a key", "NUL nested"],
    )
    async def test_data_with_a_nul_character_is_refused(
        self, store: EventStore, data: dict[str, object]
    ) -> None:
        stream = f"contract-{uuid.uuid4()}"
        with pytest.raises(IntegrityError):
            await store.append(stream, 0, [event(data)], prev_hash=GENESIS_HASH)
        assert await store.read_stream(stream) == []

    @pytest.mark.parametrize(
        "stream",
        # random, so that no compression brings it under the index's limit (~2,700 bytes)
        ["nul\x00stream", base64.b64encode(random.Random(1).randbytes(6000)).decode()],
        ids=["NUL", "too long for the index"],
    )
    async def test_a_stream_id_no_index_can_hold_is_refused(
        self, store: EventStore, stream: str
    ) -> None:
        with pytest.raises(IntegrityError):
            await store.append(stream, 0, [event({"n": 1})], prev_hash=GENESIS_HASH)


class TestInMemory(UnstorableContract):
    @pytest.fixture
    def store(self) -> EventStore:
        return InMemoryEventStore()


class TestPostgres(UnstorableContract):
    @pytest_asyncio.fixture
    async def store(self, database_url: str) -> AsyncIterator[EventStore]:
        store = PostgresEventStore.from_url(database_url, pool_size=2)
        yield store
        await store.close()
