"""The console's pages, one module each, every one a ``routes`` table the app adds."""

from __future__ import annotations

from waystation.console.pages import (
    approvals,
    dead_letters,
    overview,
    paused,
    session,
    signals,
    task,
)

__all__ = ["MODULES"]

MODULES = [session, overview, paused, task, approvals, signals, dead_letters]
