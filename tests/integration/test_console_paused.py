"""The console's paused-tasks page (issue 32, page 2) over a log of 150 generated paused tasks
(``fill_console_log``: real streams, projections caught up): following "next" from the first
page visits every matching task once, each filter shows only what it selects, and a broken
cursor is a plain 400 page."""

from __future__ import annotations

import re
from urllib.parse import unquote

import aiohttp
import pytest

from scripts._bench.console import console_database, fill_console_log
from waystation.projections.postgres import create_engine, paused_tasks
from waystation.settings import Settings

from ..support import Services
from .console_support import browser, console
from .test_console_task import assert_inert

pytestmark = pytest.mark.integration

TASK_LINK = re.compile(r'<td class="mono"><a href="/tasks/([^"]+)">')


async def _visit_all(
    session: aiohttp.ClientSession, base: str, query: str
) -> tuple[list[str], list[str]]:
    """Every task id shown from the first page through the last, and the pages' texts."""
    ids: list[str] = []
    pages: list[str] = []
    url = f"{base}/paused{query}"
    while True:
        async with session.get(url) as response:
            page = await response.text()
            assert response.status == 200, page
        pages.append(page)
        ids += [unquote(found) for found in TASK_LINK.findall(page)]
        following = re.search(r'<a href="(\?[^"]+)" rel="next">', page)
        if following is None:
            return ids, pages
        url = f"{base}/paused" + following.group(1).replace("&amp;", "&")


@pytest.mark.timeout(300)
async def test_the_paused_page_pages_and_filters_over_a_log_of_its_own(
    services: Services, settings: Settings
) -> None:
    async with console_database(services.admin_database_url) as url:
        await fill_console_log(url, tasks=150, big_events=40, seed=11)
        own = settings.model_copy(update={"database_url": url})
        engine = create_engine(url)
        try:
            every = await paused_tasks(engine, limit=10_000)
            signals = await paused_tasks(engine, waiting_for="signal", limit=10_000)
            agent = every[0]["agent"]
            of_agent = await paused_tasks(engine, agent=agent, limit=10_000)
        finally:
            await engine.dispose()
        assert len(every) > 100 and 0 < len(signals) < len(every)

        async with console(own, token=None) as base, browser() as session:
            shown, pages = await _visit_all(session, base, "")
            assert len(pages) > 1, "more than one page of 50"
            assert sorted(shown) == sorted(row["task_id"] for row in every)
            assert len(set(shown)) == len(shown), "no task twice"
            for page in pages:
                assert_inert(page)
            assert "match." in pages[0]

            shown, _ = await _visit_all(session, base, "?waiting_for=signal&order=deadline")
            assert sorted(shown) == sorted(row["task_id"] for row in signals)

            shown, _ = await _visit_all(session, base, f"?agent={agent}&order=newest")
            assert shown == [row["task_id"] for row in reversed(of_agent)], "newest first"

            # every task was paused just now: none for more than a day, and each filter says so
            shown, pages = await _visit_all(session, base, "?older_than=1d")
            assert shown == [] and "No paused task matches." in pages[0]

            async with session.get(f"{base}/paused?after=not-a-cursor") as response:
                page = await response.text()
                assert response.status == 400, page
            assert "cursor" in page
