"""The snapshot horizon of the log's readers (``read_all``, the projections' feed).

A reader stops below the oldest transaction that may still commit events of its database, so it
never skips one. A transaction of another database on the same cluster cannot, and must not hold
the reader back: on a shared server (another test run, another application) it once stalled the
contract suite's reader past its patience ("the reader never caught up"). One of the reader's own
database must, however long it stays open. What holds the horizon is named by
``projections status`` and by the ``/healthz`` of workers and projection runners.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from scripts.lab.harness.database import PostgresCluster, fresh_database_url
from scripts.lab.harness.processes import WorkerProcess, free_port, metrics_env
from waystation import migrations
from waystation.events import GENESIS_HASH, NewEvent, Position, RecordedEvent
from waystation.events.codec import loads
from waystation.events.postgres import PostgresEventStore
from waystation.settings import Settings

from ..support import Services, eventually, serving_cluster
from .test_cli import run_cli
from .test_observability import get

pytestmark = pytest.mark.integration


def probe(n: int) -> NewEvent:
    return NewEvent(uuid.uuid4(), "Probe", {"n": n}, {"worker_id": "horizon"})


async def head(store: PostgresEventStore) -> Position:
    cursor = Position()
    while batch := await store.read_all(cursor, limit=10_000):
        cursor = Position.of(batch[-1])
    return cursor


async def read_after(store: PostgresEventStore, start: Position) -> list[RecordedEvent]:
    found: list[RecordedEvent] = []
    while batch := await store.read_all(start, limit=10_000):
        found.extend(batch)
        start = Position.of(batch[-1])
    return found


def address(url: str) -> dict[str, Any]:
    parsed = make_url(url)
    return {
        "host": parsed.host or "127.0.0.1",
        "port": parsed.port or 5432,
        "user": parsed.username or "postgres",
        "database": parsed.database,
    }


@contextlib.asynccontextmanager
async def open_transaction(url: str) -> AsyncIterator[tuple[asyncpg.Connection, int]]:
    """A session of ``url``'s database in a transaction that has a transaction id, left open
    (idle in transaction) until the block ends; yields the session and the id."""
    connection = await asyncpg.connect(**address(url))
    try:
        await connection.execute("BEGIN")
        xid = int(await connection.fetchval("SELECT pg_current_xact_id()::text"))
        yield connection, xid
    finally:
        if connection.is_in_transaction():
            await connection.execute("ROLLBACK")
        await connection.close()


@contextlib.asynccontextmanager
async def scratch_database(admin_url: str) -> AsyncIterator[str]:
    """Another database on the same server, dropped afterwards."""
    url = fresh_database_url(admin_url)
    await migrations.ensure_database(url)
    try:
        yield url
    finally:
        await migrations.drop_database(url)


async def running_in_snapshot(store: PostgresEventStore, xid: int) -> bool:
    """Whether a statement of the store's database sees ``xid`` as running."""
    async with store.engine.connect() as connection:
        return bool(
            await connection.scalar(
                text(
                    """
                    SELECT CAST(CAST(:xid AS text) AS xid8)
                           IN (SELECT pg_snapshot_xip(pg_current_snapshot()))
                    """
                ),
                {"xid": str(xid)},
            )
        )


# ---- the reader ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
async def test_a_transaction_open_in_another_database_does_not_hold_back_a_reader(
    store: PostgresEventStore, services: Services
) -> None:
    start = await head(store)
    async with (
        scratch_database(services.admin_database_url) as elsewhere,
        open_transaction(elsewhere) as (_, xid),
    ):
        stream = f"horizon-{uuid.uuid4()}"
        await store.append(stream, 0, [probe(1), probe(2)], prev_hash=GENESIS_HASH)
        [committed] = {e.tx_id for e in await store.read_stream(stream)}
        # the other database's transaction is older and still running: what held readers back
        assert xid < committed and await running_in_snapshot(store, xid)

        async def read() -> bool:
            return [e.stream_id for e in await read_after(store, start)].count(stream) == 2

        await eventually(read, 30, "the reader to read past the other database's transaction")
        assert await running_in_snapshot(store, xid)


@pytest.mark.timeout(120)
async def test_a_transaction_open_in_the_same_database_holds_back_a_reader_until_it_ends(
    store: PostgresEventStore, database_url: str
) -> None:
    start = await head(store)
    slow, fast = f"horizon-slow-{uuid.uuid4()}", f"horizon-fast-{uuid.uuid4()}"
    async with open_transaction(database_url) as (session, xid):
        # it writes an event, and commits it after a later transaction has committed its own
        await session.execute(
            """
            INSERT INTO events (stream_id, stream_version, event_id, event_type, data, metadata,
                                prev_hash, hash)
            VALUES ($1, 1, $2, 'Probe', '{}', '{}', '', '')
            """,
            slow,
            uuid.uuid4(),
        )
        await store.append(fast, 0, [probe(1)], prev_hash=GENESIS_HASH)
        [committed] = {e.tx_id for e in await store.read_stream(fast)}
        assert xid < committed
        seen = {e.stream_id for e in await read_after(store, start)}
        assert fast not in seen, "the reader moved past a transaction of its own database"
        await session.execute("COMMIT")

    async def both() -> list[str]:
        return [e.stream_id for e in await read_after(store, start) if e.stream_id in (slow, fast)]

    async def both_read() -> bool:
        return len(await both()) == 2

    await eventually(both_read, 30, "the reader to read both events once the transaction ended")
    assert await both() == [slow, fast]  # in commit order


@pytest.mark.timeout(180)
async def test_a_prepared_transaction_holds_back_readers_of_its_own_database_only(
    database_url: str,
) -> None:
    """A prepared (two-phase) transaction has no session: pg_prepared_xacts names its database.
    On a scratch cluster, since the shared server does not allow prepared transactions."""
    home = serving_cluster(database_url, "a scratch cluster")
    async with PostgresCluster.scratch(home.version) as cluster:
        admin = await asyncpg.connect(**address(cluster.url("postgres")))
        try:
            await admin.execute("ALTER SYSTEM SET max_prepared_transactions = 4")
        finally:
            await admin.close()
        await cluster.stop()
        await cluster.start()
        ours, elsewhere = cluster.url("waystation_ours"), cluster.url("waystation_elsewhere")
        await migrations.upgrade(ours)
        await migrations.ensure_database(elsewhere)
        store = PostgresEventStore.from_url(ours, pool_size=2)
        try:
            for database, holds in ((elsewhere, False), (ours, True)):
                start = await head(store)
                gid = f"horizon-{uuid.uuid4()}"
                preparer = await asyncpg.connect(**address(database))
                try:
                    await preparer.execute("BEGIN")
                    await preparer.fetchval("SELECT pg_current_xact_id()")
                    await preparer.execute(f"PREPARE TRANSACTION '{gid}'")
                finally:
                    await preparer.close()  # the prepared transaction outlives its session
                try:
                    stream = f"horizon-{uuid.uuid4()}"
                    await store.append(stream, 0, [probe(1)], prev_hash=GENESIS_HASH)
                    read = [e.stream_id for e in await read_after(store, start)]
                    assert (stream not in read) == holds, database
                finally:
                    finisher = await asyncpg.connect(**address(database))
                    try:
                        await finisher.execute(f"ROLLBACK PREPARED '{gid}'")
                    finally:
                        await finisher.close()
        finally:
            await store.close()


@pytest.mark.timeout(180)
async def test_a_reader_paging_across_a_power_of_ten_of_transaction_ids_skips_nothing(
    database_url: str,
) -> None:
    """Transaction 10000 sorts before 9999 as text: paging must order by the number.

    The counter of a scratch cluster is moved to just below 10000 (``pg_resetwal -x``, within
    the first page of its commit log), then events are appended one transaction each until their
    ids have crossed it.
    """
    home = serving_cluster(database_url, "a scratch cluster")
    async with PostgresCluster.scratch(home.version) as cluster:
        await cluster.stop()
        await set_next_transaction_id(cluster, 9_900)
        await cluster.start()
        url = cluster.url("waystation_digits")
        await migrations.upgrade(url)
        store = PostgresEventStore.from_url(url, pool_size=2)
        try:
            written: list[RecordedEvent] = []
            while not written or written[-1].tx_id < 10_005:
                assert len(written) < 1_000, "the transaction ids never reached 10005"
                stream = f"digits-{uuid.uuid4()}"
                await store.append(stream, 0, [probe(len(written))], prev_hash=GENESIS_HASH)
                written.extend(await store.read_stream(stream))
            assert written[0].tx_id < 10_000
            for limit in (1, 7, 10_000):
                read: list[RecordedEvent] = []
                cursor = Position()
                while batch := await store.read_all(cursor, limit=limit):
                    read.extend(batch)
                    cursor = Position.of(batch[-1])
                assert [e.event_id for e in read] == [e.event_id for e in written], limit
        finally:
            await store.close()


async def set_next_transaction_id(cluster: PostgresCluster, xid: int) -> None:
    """``pg_resetwal -x`` on the (stopped) cluster, as its owner."""
    listing = await run_tool("pg_lsclusters", "--no-header", cluster.version, cluster.name)
    data_directory = listing.split()[5]
    command = [f"/usr/lib/postgresql/{cluster.version}/bin/pg_resetwal", "-x", str(xid)]
    if os.geteuid() == 0:  # pg_resetwal refuses root
        command = ["runuser", "-u", "postgres", "--", *command]
    await run_tool(*command, data_directory)


async def run_tool(*command: str) -> str:
    running = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    output, _ = await running.communicate()
    assert running.returncode == 0, f"{command[0]}: {output.decode()}"
    return output.decode()


# ---- naming what holds it ------------------------------------------------------------------------


async def horizon_of_healthz(port: int) -> Any:
    status, body = await get(f"http://127.0.0.1:{port}/healthz")
    assert status == 200, body
    return orjson.loads(body)["horizon"]


@pytest.mark.timeout(120)
async def test_projections_status_and_healthz_name_what_holds_the_horizon(
    settings: Settings, database_url: str, tmp_path: Path
) -> None:
    ports = free_port(), free_port()
    processes = [
        WorkerProcess.with_settings(
            settings,
            tmp_path / f"{name}.log",
            env=metrics_env(port),
            command=command,
        ).start()
        for port, name, command in (
            (ports[0], "worker", None),
            (ports[1], "runner", ["projections", "run"]),
        )
    ]
    try:
        async with open_transaction(database_url) as (session, xid):
            await session.execute("SET application_name = 'horizon-holder'")
            pid = await session.fetchval("SELECT pg_backend_pid()")
            database = make_url(database_url).database

            def names_the_holder(horizon: Any) -> bool:
                return horizon is not None and horizon["pid"] == pid

            for port in ports:
                found: list[Any] = []

                async def served(port: int = port, found: list[Any] = found) -> bool:
                    try:
                        found.append(await horizon_of_healthz(port))
                    except (OSError, AssertionError):  # still starting
                        return False
                    return names_the_holder(found[-1])

                await eventually(served, 60, f"/healthz on port {port} to name the holder")
                horizon = found[-1]
                assert horizon["xid"] == xid and horizon["database"] == database
                assert horizon["state"] == "idle in transaction"
                assert horizon["application_name"] == "horizon-holder"
                assert isinstance(horizon["age_seconds"], float) and horizon["age_seconds"] >= 0

            shown = await asyncio.to_thread(run_cli, settings, "projections", "status", "--json")
            assert shown.returncode == 0, shown.stderr
            horizons = [p["horizon"] for p in loads(shown.stdout)]
            assert all(names_the_holder(h) for h in horizons), horizons
            table = await asyncio.to_thread(run_cli, settings, "projections", "status")
            assert table.returncode == 0, table.stderr
            [line] = [ln for ln in table.stdout.splitlines() if ln.startswith("horizon")]
            for shown_part in (f"pid {pid}", database, "idle in transaction", "horizon-holder"):
                assert shown_part in line, line
        shown = await asyncio.to_thread(run_cli, settings, "projections", "status", "--json")
        assert not any(p["horizon"] and p["horizon"]["pid"] == pid for p in loads(shown.stdout)), (
            "the ended transaction is still named"
        )
    finally:
        codes = [p.stop() for p in processes]
    assert codes == [0, 0]
