"""The console's overview (issue 32, page 1) on real workers, PostgreSQL and RabbitMQ: each
agent's rates, latency, totals and open calls come from the projections once they have caught
up with the log, and a console that knows nothing yet says so instead of showing zeros as facts."""

from __future__ import annotations

import re

import pytest

from waystation.client import Client
from waystation.events.postgres import PostgresEventStore
from waystation.projections.postgres import PROJECTIONS, catch_up, create_engine
from waystation.settings import Settings

from ..support import running_worker
from .console_support import browser, console
from .test_console_task import assert_inert, tree_app

pytestmark = pytest.mark.integration


async def _catch_up(settings: Settings) -> None:
    engine = create_engine(settings.database_url)
    try:
        async with engine.connect() as connection:
            for projection in PROJECTIONS.values():
                await catch_up(connection, projection)
    finally:
        await engine.dispose()


def _row(page: str, agent: str) -> list[str]:
    """The cells of ``agent``'s row in the agents' table."""
    table = page.split('<table class="agents">')[1].split("</table>")[0]
    for row in table.split("<tr>")[1:]:
        if f">{agent}</a>" in row:
            cells = [re.sub(r"<[^>]+>", "", "<td" + cell) for cell in row.split("<td")[1:]]
            return [" ".join(cell.split()) for cell in cells]
    raise AssertionError(f"no row of {agent} in:\n{table}")


@pytest.mark.timeout(180)
async def test_the_overview_shows_each_agents_figures_from_the_projections(
    own_log: tuple[Settings, PostgresEventStore],
) -> None:
    settings, store = own_log
    async with console(settings, token=None) as base, browser() as session:
        async with session.get(f"{base}/") as response:
            page = await response.text()
            assert response.status == 200, page
        assert "No agent has recorded anything in the log yet" in page

        async with (
            running_worker(tree_app(), settings, store),
            Client(settings.amqp_url, queue_prefix=settings.queue_prefix) as client,
        ):
            ids = [await client.submit("ct-boss", {"note": f"n{n}"}) for n in range(3)]
            for task_id in ids:
                assert (await client.result(task_id, timeout=60)).ok
        await _catch_up(settings)

        async with session.get(f"{base}/") as response:
            page = await response.text()
            assert response.status == 200, page
    assert_inert(page)
    boss = _row(page, "ct-boss")
    # started, completed and failed per minute over a 15-minute window (3 tasks: 0.2 a minute
    # when the window holds 15 minutes and a bit; more when the minute has just begun)
    assert boss[0] == "ct-boss"
    started, completed, failed = (float(cell) for cell in boss[1:4])
    assert started > 0 and completed > 0 and failed == 0, boss
    assert boss[4] != "-" and boss[5] != "-", f"p50 and p99 of three logged tasks: {boss}"
    assert boss[7:9] == ["0", "0"], f"none paused now, no call open: {boss}"
    assert boss[9] == "no pool limit", boss
    assert boss[10:14] == ["3", "0", "0", "0"], f"completed, failed, cancelled, timed out: {boss}"
    middle = _row(page, "ct-middle")
    assert middle[10] == "3", middle
    # the leaf never paused: the log has none of its tasks, only the calls to it that closed
    assert "ct-leaf" not in page.split('<table class="agents">')[1].split("</table>")[0]
    for name in PROJECTIONS:
        assert f"<td>{name}</td>" in page
    assert "Nothing holds the log's horizon back." in page
    assert re.search(r"\d+ dead letters?</a> waiting", page), "the broker's count"
