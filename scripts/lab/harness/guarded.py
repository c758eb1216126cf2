"""Running a script's work with a guaranteed cleanup: :func:`run_guarded` (bench, demo, chaos).

Whatever stops the work (an error, Ctrl-C, SIGTERM), the cleanup runs: the script's workers
stopped, its queues and databases removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run_guarded(
    work: Callable[[], Awaitable[Any]],
    cleanup: Callable[[], Awaitable[None]],
    on_interrupt: Callable[[], None],
    *,
    name: str,
    give_up_after: float = 20.0,
    uvloop: bool = True,
) -> tuple[Any, BaseException | None, bool]:
    """Run ``work()`` then, whatever happened, ``cleanup()``; (result, error, interrupted).

    SIGINT and SIGTERM call ``on_interrupt`` (stop the workers now) and cancel the work, again
    every 2 seconds while it is still running, and stop waiting for it after ``give_up_after``
    seconds; the cleanup then runs regardless (a signal during the cleanup only says so). On
    uvloop when it is installed, like the workers, unless ``uvloop`` is false: a child that
    starts a daemon (``pg_ctlcluster start``) never looks finished to uvloop, whose children
    inherit a pipe of its own that the daemon then holds open.
    """
    loop = _new_loop() if uvloop else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    state = {"interrupted_at": 0.0, "cleaning": False}
    task: asyncio.Task[Any] = loop.create_task(work())  # type: ignore[arg-type]

    def on_signal() -> None:
        if state["cleaning"]:
            print(f"{name}: cleaning up, please wait", file=sys.stderr, flush=True)
            return
        if not state["interrupted_at"]:
            state["interrupted_at"] = time.monotonic()
            print(
                f"\n{name}: interrupted; stopping the workers and cleaning up",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(Exception):
                on_interrupt()
        task.cancel()

    async def supervise() -> None:
        last_cancel = 0.0
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            started = state["interrupted_at"]
            if started and not task.done():
                now = time.monotonic()
                if now - started > give_up_after:
                    print(
                        f"{name}: the run did not stop within {give_up_after:.0f}s; "
                        "cleaning up anyway",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
                if now - last_cancel > 2:
                    task.cancel()
                    last_cancel = now

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    result: Any = None
    error: BaseException | None = None
    try:
        loop.run_until_complete(supervise())
        if task.done():
            if task.cancelled():
                error = asyncio.CancelledError()
            else:
                error = task.exception()
                result = None if error else task.result()
        else:
            error = TimeoutError("the run did not stop")
        state["cleaning"] = True
        try:
            loop.run_until_complete(asyncio.wait_for(cleanup(), 120))
        except Exception as cleanup_error:
            print(
                f"{name}: cleanup failed: {type(cleanup_error).__name__}: {cleanup_error}",
                file=sys.stderr,
            )
            error = error or cleanup_error
        # whatever is still pending (a stuck task of the run): cancel it, briefly
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for stray in pending:
            stray.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=3))
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        asyncio.set_event_loop(None)
        loop.close()
    return result, error, bool(state["interrupted_at"])
