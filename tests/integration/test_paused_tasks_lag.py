"""``waystation tasks`` says when the paused-tasks projection cannot be trusted: it has never run,
or it is behind the log with no runner active. The line goes to stderr (``--json`` stays rows
alone), and with no row it does not claim "no paused tasks". It used to say just that, with a task
paused in the log and no runner to see it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from scripts.lab.harness.database import fresh_database_url
from scripts.lab.harness.processes import WorkerProcess, worker_environment
from waystation import migrations
from waystation.events.codec import loads
from waystation.events.postgres import PostgresEventStore
from waystation.events.simulation import simulate
from waystation.projections.postgres import PROJECTIONS, catch_up, create_engine
from waystation.settings import Settings

from ..support import Services, count_rows, eventually
from .test_cli import run_cli

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def own_log(services: Services, settings: Settings) -> AsyncIterator[Settings]:
    """``settings`` on a fresh database of this test's own (the session's is shared: its
    projections are anybody's)."""
    url = fresh_database_url(services.admin_database_url)
    await migrations.upgrade(url)
    try:
        yield settings.model_copy(update={"database_url": url})
    finally:
        await migrations.drop_database(url)


async def tasks_command(settings: Settings, *args: str) -> tuple[str, str]:
    """``waystation tasks ARGS``: its stdout and stderr, once it exited 0 without a traceback."""
    done = await asyncio.to_thread(run_cli, settings, "tasks", *args)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    return done.stdout, done.stderr


async def paused_in(store: PostgresEventStore, seed: int) -> set[str]:
    """Tasks written to the log by ``simulate`` (every one left at its first pause, or
    finished before): those paused."""
    tasks = await simulate(store, tasks=12, writers=2, seed=seed, prefix=f"s{seed}", leave_paused=1)
    return {t.task_id for t in tasks if t.state is not None and t.state.status == "paused"}


async def test_tasks_says_when_the_projection_never_ran_or_is_behind_with_no_runner(
    own_log: Settings, tmp_path: Path
) -> None:
    settings = own_log
    store = PostgresEventStore.from_url(settings.database_url, pool_size=4)
    engine = create_engine(settings.database_url)
    try:
        paused = await paused_in(store, seed=1)
        assert paused, "the simulation left no task paused: proves nothing"
        events = await count_rows(store, "events")

        # never run: the log holds paused tasks the projection has not seen
        table, said = await tasks_command(settings)
        assert said.strip() == (
            f"the paused-tasks projection has never run: none of the {events} events in the log "
            "is applied, so paused tasks may be missing; start `waystation projections run`, or "
            "see `waystation projections status`"
        )
        assert table.strip() != "no paused tasks", "it cannot know that"
        rows, said_too = await tasks_command(settings, "--json")
        assert loads(rows) == [] and said_too == said, "--json: rows on stdout, the line on stderr"

        # applied up to the head (a runner ran, and stopped): nothing to say
        async with engine.connect() as connection:
            for projection in PROJECTIONS.values():
                await catch_up(connection, projection)
        rows, said = await tasks_command(settings, "--json")
        assert said == ""
        assert {row["task_id"] for row in loads(rows)} == paused

        # more events since, and no runner to apply them
        more = await paused_in(store, seed=2)
        behind = await count_rows(store, "events") - events
        table, said = await tasks_command(settings)
        assert said.startswith(
            f"the paused-tasks projection is {behind} events behind the log (last applied "
        ), said
        assert "ago) and no runner is active" in said and "`waystation projections run`" in said
        listed = {line.split()[0] for line in table.splitlines()[1:]}
        assert listed == paused, "the rows as the projection has them"

        # a runner catches up: the warning goes
        runner = WorkerProcess(
            worker_environment(settings), tmp_path / "runner.log", command=["projections", "run"]
        ).start()
        try:

            async def caught_up() -> bool:
                assert runner.alive(), runner.log_path.read_text()
                rows, said = await tasks_command(settings, "--json")
                return said == "" and {row["task_id"] for row in loads(rows)} == paused | more

            await eventually(caught_up, 60, "the runner to catch up and the warning to go")
        finally:
            assert runner.stop() == 0
    finally:
        await engine.dispose()
        await store.close()
