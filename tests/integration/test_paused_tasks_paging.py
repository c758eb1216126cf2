"""Paging through the paused tasks (``paused_tasks_page``, issue 32's console) on real
PostgreSQL, and the console's log generator (``scripts/_bench/console.py``) that fills it.

The log is written by :func:`fill_console_log` (real streams through the store's append, the
projections brought up to date by their runner's ``catch_up``); what each filter and order
should give is computed here from the table's rows themselves, and every page is read through
both plans a page may take: the filter's rows read whole and sorted, and the order's index
walked (with the total estimated instead of counted).
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from scripts._bench.console import console_database, fill_console_log, write_tasks
from waystation.events import EventMetadata, NewEvent, decide_cancel, event_id, fold
from waystation.events.postgres import PostgresEventStore
from waystation.projections.postgres import (
    PAGE_ORDERS,
    PROJECTIONS,
    catch_up,
    create_engine,
    paused_tasks,
    paused_tasks_page,
    queries,
    rebuild,
)
from waystation.settings import Settings

from ..support import Services
from .test_cli import run_cli

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def console_log(
    services: Services,
) -> AsyncIterator[tuple[str, PostgresEventStore, AsyncEngine]]:
    """A database of its own filled with 150 tasks: its URL, a store and a projections engine."""
    async with console_database(services.admin_database_url) as url:
        await fill_console_log(url, tasks=150, big_events=40, seed=7)
        store = PostgresEventStore.from_url(url, pool_size=3)
        engine = create_engine(url)
        try:
            yield url, store, engine
        finally:
            await engine.dispose()
            await store.close()


async def _all_rows(engine: AsyncEngine) -> list[dict[str, Any]]:
    async with engine.connect() as connection:
        result = await connection.execute(
            text(
                "SELECT task_id, agent, status, waits, paused_since, earliest_deadline "
                "FROM paused_tasks"
            )
        )
        return [dict(row._mapping) for row in result]


def _selects(row: dict[str, Any], filters: dict[str, Any]) -> bool:
    """Whether ``filters`` select ``row``, as the page's docstring defines them."""
    waits = row["waits"]
    checks = {
        "agent": lambda v: row["agent"] == v,
        "status": lambda v: row["status"] == v,
        "waiting_for": lambda v: any(w["kind"] == v for w in waits),
        "signal": lambda v: any(w["kind"] == "signal" and w.get("name") == v for w in waits),
        "paused_before": lambda v: row["paused_since"] < v,
        "paused_after": lambda v: row["paused_since"] >= v,
        "deadline_before": lambda v: (
            row["earliest_deadline"] is not None and row["earliest_deadline"] < v
        ),
    }
    return all(checks[name](value) for name, value in filters.items())


def _in_order(rows: list[dict[str, Any]], order: str) -> list[str]:
    def deadline(row: dict[str, Any]) -> tuple[datetime, str]:
        """No deadline (a resumed row) after every deadline; ties by task id."""
        return (row["earliest_deadline"] or datetime.max.replace(tzinfo=UTC), row["task_id"])

    if order == "deadline":
        return [r["task_id"] for r in sorted(rows, key=deadline)]
    ordered = [r["task_id"] for r in sorted(rows, key=lambda r: (r["paused_since"], r["task_id"]))]
    return ordered[::-1] if order == "newest" else ordered


async def _every_page(engine: AsyncEngine, limit: int, **filters: Any) -> tuple[list[str], Any]:
    """The task ids of every page to the end, and the first page."""
    first = page = await paused_tasks_page(engine, limit=limit, **filters)
    ids = [r["task_id"] for r in page.rows]
    while page.next is not None:
        assert len(page.rows) == limit
        page = await paused_tasks_page(engine, limit=limit, after=page.next, **filters)
        ids += [r["task_id"] for r in page.rows]
    return ids, first


@pytest.mark.parametrize("plan", ["whole", "along the index"])
async def test_each_filter_and_order_pages_through_exactly_the_rows_it_selects(
    console_log: tuple[str, PostgresEventStore, AsyncEngine],
    plan: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, _, engine = console_log
    if plan == "along the index":  # as a filter of thousands of rows is read: estimated too
        monkeypatch.setattr(queries, "WHOLE_UP_TO", 0)
        monkeypatch.setattr(queries, "COUNT_UP_TO", 0)
    rows = await _all_rows(engine)
    assert len(rows) == 150
    since = sorted(r["paused_since"] for r in rows)
    deadlines = sorted(r["earliest_deadline"] for r in rows if r["earliest_deadline"])
    middle, quarter = since[len(since) // 2], since[len(since) // 4]
    soon = deadlines[len(deadlines) // 3]
    cases: list[dict[str, Any]] = [
        {},
        {"agent": "orchestrator"},
        {"status": "resumed"},
        {"waiting_for": "call"},
        {"waiting_for": "signal"},
        {"waiting_for": "timer"},
        {"signal": "approval"},
        {"signal": "approval", "waiting_for": "signal"},
        {"paused_before": middle},
        {"paused_after": middle},
        {"deadline_before": soon},
        {"agent": "orchestrator", "waiting_for": "call", "paused_after": quarter},
        {"signal": "approval", "deadline_before": deadlines[-1], "paused_before": middle},
        {"agent": "no-such-agent"},
    ]
    for filters in cases:
        expected_rows = [r for r in rows if _selects(r, filters)]
        for order in PAGE_ORDERS:
            ids, first = await _every_page(engine, 7, order=order, **filters)
            assert ids == _in_order(expected_rows, order), (filters, order)
            if plan == "whole":
                assert (first.total, first.total_exact) == (len(expected_rows), True)
            else:
                assert first.total_exact is False and first.total >= 0
    assert (await paused_tasks(engine, limit=500)) == (
        await paused_tasks_page(engine, limit=500)
    ).rows


async def _cancel(store: PostgresEventStore, task_id: str) -> None:
    state = fold(task_id, await store.read_stream(task_id))
    metadata = EventMetadata(worker_id="test", causation_id=f"cancel:{task_id}")
    events = [
        NewEvent.of(event_id(task_id, "cancel", i), e, metadata)
        for i, e in enumerate(decide_cancel(state, "the test"))
    ]
    await store.append(task_id, state.version, events, prev_hash=state.last_hash)


@pytest.mark.parametrize("order", PAGE_ORDERS)
async def test_paging_to_the_end_visits_each_row_once_while_rows_come_and_go(
    console_log: tuple[str, PostgresEventStore, AsyncEngine], order: str
) -> None:
    _, store, engine = console_log
    at_start = {r["task_id"] for r in await _all_rows(engine)}
    rng = random.Random(order)
    visited: list[str] = []
    removed: set[str] = set()
    page = await paused_tasks_page(engine, order=order, limit=12)
    while True:
        present = {r["task_id"] for r in await _all_rows(engine)}
        assert {r["task_id"] for r in page.rows} <= present
        visited += [r["task_id"] for r in page.rows]
        if page.next is None:
            break
        # between pages: two rows not visited yet and one visited go, three new tasks pause
        unvisited = sorted(present - set(visited))
        seen = sorted(present & set(visited))
        going = rng.sample(unvisited, min(2, len(unvisited))) + rng.sample(seen, 1)
        for task_id in going:
            await _cancel(store, task_id)
        removed |= set(going)
        await write_tasks(store, rng, 3, time.time(), writer=9)
        async with engine.connect() as connection:
            await catch_up(connection, PROJECTIONS["paused_tasks"])
        page = await paused_tasks_page(engine, order=order, after=page.next, limit=12)
    assert len(visited) == len(set(visited)), "a row was visited twice"
    assert at_start - removed <= set(visited), "a row that stayed was skipped"
    assert len(removed) > 10


async def test_a_cursor_of_another_order_or_no_cursor_at_all_is_refused(
    console_log: tuple[str, PostgresEventStore, AsyncEngine],
) -> None:
    _, _, engine = console_log
    oldest = await paused_tasks_page(engine, order="oldest", limit=5)
    assert oldest.next is not None
    for order in ("newest", "deadline"):
        with pytest.raises(ValueError, match="this cursor pages in the order 'oldest', not"):
            await paused_tasks_page(engine, order=order, after=oldest.next)

    def encoded(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).decode()

    bad = [
        "",
        "not a cursor",
        "%%%",
        encoded(b"not json"),
        encoded(b"[1, 2]"),
        encoded(b'{"order": "oldest"}'),
        encoded(b'{"order": "sideways", "key": ["2026-01-01T00:00:00+00:00", "t"]}'),
        encoded(b'{"order": "oldest", "key": ["yesterday", "t"]}'),
        encoded(b'{"order": "oldest", "key": ["2026-01-01T00:00:00+00:00"]}'),
        encoded(b'{"order": "oldest", "key": [1, 2]}'),
    ]
    for cursor in bad:
        with pytest.raises(ValueError, match="not a cursor of the paused tasks' pages"):
            await paused_tasks_page(engine, after=cursor)
    with pytest.raises(ValueError, match="the order is one of"):
        await paused_tasks_page(engine, order="sideways")
    with pytest.raises(ValueError, match="a wait is a call, a signal, a timer"):
        await paused_tasks_page(engine, waiting_for="webhook")


async def test_the_console_log_is_valid_mixed_and_what_a_rebuild_gives(
    services: Services, settings: Settings
) -> None:
    async with console_database(services.admin_database_url) as url:
        before = datetime.now(UTC)
        log = await fill_console_log(url, tasks=200, big_events=300)
        with pytest.raises(ValueError, match="fills an empty log"):
            await fill_console_log(url, tasks=1)
        done = await asyncio.to_thread(
            run_cli, settings.model_copy(update={"database_url": url}), "verify"
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "200 streams" in done.stdout and "no problems" in done.stdout
        engine = create_engine(url)
        try:
            rows = await _all_rows(engine)
            assert len(rows) == 200 and log.tasks == 200
            assert len(log.task_ids) == 100 and set(log.task_ids) <= {r["task_id"] for r in rows}
            kinds = {w["kind"] for r in rows for w in r["waits"]}
            assert kinds == {"call", "signal", "timer"}
            assert len({r["agent"] for r in rows}) >= 5
            assert {r["status"] for r in rows} == {"paused", "resumed"}
            deadlines = [r["earliest_deadline"] for r in rows if r["earliest_deadline"]]
            assert min(deadlines) > before and max(deadlines) > before + timedelta(days=1)
            async with engine.connect() as connection:
                big = await connection.scalar(
                    text("SELECT count(*) FROM events WHERE stream_id = :t"),
                    {"t": log.big_task_id},
                )
            assert 300 <= big < 310 and log.events > big + 200
            big_row = next(r for r in rows if r["task_id"] == log.big_task_id)
            assert big_row["status"] == "paused"
            for projection in PROJECTIONS.values():
                report = await rebuild(engine, projection, check_only=True)
                assert report.identical, report.to_json()
        finally:
            await engine.dispose()
