"""``waystation console``: the web console (:mod:`waystation.console`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import click

from waystation import migrations
from waystation.cli.wiring import load_settings

if TYPE_CHECKING:
    from waystation.settings import Settings

__all__ = ["console"]

log = logging.getLogger("waystation")

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


@click.command()
@click.option("--host", help="Address to listen on (default 127.0.0.1: this host only).")
@click.option("--port", type=int, help="Port to listen on (default 8470; 0: any free port).")
def console(host: str | None, port: int | None) -> None:
    """Serve the web console: paused tasks, approvals, dead letters, each task's history.

    It reads the log and its projections (run `waystation projections run` beside it, or the
    paused tasks and figures stay as they were). With WAYSTATION_CONSOLE_TOKEN set, a person who
    signs in with that token can cancel tasks, answer signals and replay dead letters, each
    action recorded in the log with their name; without it, the console is read-only.
    Listens on 127.0.0.1 unless --host (or WAYSTATION_CONSOLE_HOST) says otherwise. Runs until
    SIGTERM or SIGINT. See docs/console.md.
    """
    from waystation.cli.serve import _run_service

    settings = load_settings(console_host=host, console_port=port)
    _run_service(_serve_console(settings))


async def _serve_console(settings: Settings) -> None:
    from aiohttp import web

    from waystation.cli.serve import _spare_the_collector, _stop_on_signal
    from waystation.cli.wiring import until_started
    from waystation.console import make_app

    stop = _stop_on_signal()
    if not await until_started(stop, lambda: migrations.upgrade(settings.database_url)):
        return
    token = settings.console_token.get_secret_value() if settings.console_token else None
    if settings.console_host not in LOCAL_HOSTS:
        log.warning(
            "the console listens on %s, beyond this host%s",
            settings.console_host,
            "; its token travels in clear over plain HTTP: put TLS in front"
            if token
            else " (read-only: no WAYSTATION_CONSOLE_TOKEN)",
        )
    runner = web.AppRunner(make_app(settings, token=token), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.console_host, settings.console_port)
    try:
        await site.start()
    except OSError as error:
        await runner.cleanup()
        raise click.ClickException(
            f"the console cannot listen on {settings.console_host}:{settings.console_port}: "
            f"{error.strerror}; choose another with --port or WAYSTATION_CONSOLE_PORT"
        ) from None
    # a page of a long task makes many short-lived objects: as in a worker, what start-up built
    # is kept out of the cycle collector's walks
    _spare_the_collector()
    for address in runner.addresses:
        host, port = address[0], address[1]
        shown = f"[{host}]" if ":" in host else host
        log.info(
            "console on http://%s:%s/ (%s)",
            shown,
            port,
            "actions need a sign-in" if token else "read-only: no WAYSTATION_CONSOLE_TOKEN",
        )
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()
