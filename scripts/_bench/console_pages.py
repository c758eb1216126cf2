"""The console's pages timed (``scripts/bench --only console``, issue 32).

A fresh database is filled by :func:`.console.fill_console_log` (100,000 paused tasks by
default, and one task of about 1,000 events), a console is served on it in this process, and
each page is requested in turn: a few unmeasured requests, then ``requests`` measured ones. The
figure is the server's time, which the console reports on every response (``Server-Timing``:
from the request reaching the application to the response leaving it; rendering included), with
the client's wall time beside it. The pages:

* ``overview``: every agent's figures (``agent_minutes``, ``agent_stats``, open calls, slots)
  and the projections' status;
* ``paused``: the first page of the paused tasks (oldest first, with its count); ``paused
  signal, deadline order`` and ``paused agent, newest``: two filters; ``paused page 20``: the
  twentieth page, reached by following "next" (keyset paging: it costs what the first does);
* ``approvals``: the inbox (the first 100 tasks waiting for a signal, each read from its stream);
* ``task``: the page of a task of the sample; ``task of 1,000 events``: the long task's page;
* ``dead letters`` is left out: it reads the broker, not the log.
"""

from __future__ import annotations

import re
import statistics
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from waystation.cli.serve import _spare_the_collector as spare_the_collector
from waystation.console import make_app
from waystation.settings import Settings

from .console import console_database, fill_console_log

WARMUP = 3
TARGET_MS = 300.0
"""The issue's budget for the paused-tasks page and a task page of 1,000 events."""


async def console_benchmark(
    admin_url: str, amqp_url: str, *, tasks: int, requests: int
) -> dict[str, Any]:
    async with console_database(admin_url) as url:
        log = await fill_console_log(url, tasks=tasks)
        print(
            f"console: {log.tasks:,} tasks, {log.events:,} events written in "
            f"{log.write_seconds:.0f}s, projections caught up in {log.projection_seconds:.0f}s",
            flush=True,
        )
        settings = Settings(
            database_url=url,
            amqp_url=amqp_url,
            queue_prefix=f"bench-console-{uuid.uuid4().hex[:6]}.",
        )
        runner = web.AppRunner(make_app(settings, token=None), access_log=None)
        spare_the_collector()  # as `waystation console` does once it listens
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        base = f"http://{host}:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                some_agent = await _first_agent(session, base)
                deep = await _follow_next(session, f"{base}/paused", 19)
                pages = {
                    "overview": "/",
                    "paused": "/paused",
                    "paused signal, deadline order": "/paused?waiting_for=signal&order=deadline",
                    "paused agent, newest": f"/paused?agent={some_agent}&order=newest",
                    "paused page 20": deep,
                    "approvals": "/approvals",
                    "task": f"/tasks/{log.task_ids[0]}",
                    "task of 1,000+ events": f"/tasks/{log.big_task_id}",
                }
                timings = {
                    name: await _time(session, base + path, requests)
                    for name, path in pages.items()
                }
        finally:
            await runner.cleanup()
    print(f"\nconsole pages over {log.tasks:,} paused tasks ({requests} requests each):")
    print(f"  {'page':<34} {'server p50':>11} {'server p90':>11} {'max':>9} {'wall p50':>9}")
    for name, t in timings.items():
        print(
            f"  {name:<34} {t['server_ms_p50']:>9.1f}ms {t['server_ms_p90']:>9.1f}ms "
            f"{t['server_ms_max']:>7.1f}ms {t['wall_ms_p50']:>7.1f}ms"
        )
    over = [name for name, t in timings.items() if t["server_ms_p50"] > TARGET_MS]
    print(
        f"  under {TARGET_MS:.0f} ms (median server time): "
        + ("every page" if not over else f"all but {', '.join(over)}")
    )
    return {
        "tasks": log.tasks,
        "events": log.events,
        "write_seconds": log.write_seconds,
        "projection_seconds": log.projection_seconds,
        "requests": requests,
        "pages": timings,
    }


async def _first_agent(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(f"{base}/paused") as response:
        page = await response.text()
    found = re.search(r'<td class="mono"><a [^>]+>[^<]+</a></td>\s*<td>([^<]+)</td>', page)
    if found is None:
        raise RuntimeError("the paused-tasks page shows no task")
    return found.group(1)


async def _follow_next(session: aiohttp.ClientSession, url: str, times: int) -> str:
    """The path of the page ``times`` "next" links after ``url``."""
    path = url[url.index("/paused") :]
    base = url[: url.index("/paused")]
    for _ in range(times):
        async with session.get(base + path) as response:
            page = await response.text()
        found = re.search(r'<a href="(\?[^"]+)" rel="next">', page)
        if found is None:
            raise RuntimeError(f"no next page after {path}")
        path = "/paused" + found.group(1).replace("&amp;", "&")
    return path


async def _time(session: aiohttp.ClientSession, url: str, requests: int) -> dict[str, float]:
    server: list[float] = []
    wall: list[float] = []
    for index in range(WARMUP + requests):
        started = time.perf_counter()
        async with session.get(url) as response:
            await response.read()
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}")
            timing = response.headers["Server-Timing"]
        elapsed = (time.perf_counter() - started) * 1000
        if index >= WARMUP:
            server.append(float(timing.partition("dur=")[2]))
            wall.append(elapsed)
    server.sort()
    return {
        "server_ms_p50": statistics.median(server),
        "server_ms_p90": server[int(len(server) * 0.9) - 1] if len(server) >= 10 else server[-1],
        "server_ms_max": server[-1],
        "wall_ms_p50": statistics.median(wall),
    }
