"""Waystation: a broker-driven, event-sourced worker pool for agents that call other agents.

The public API: an :class:`App` of agents whose handlers :class:`Complete` or :class:`Pause` on
waits: :class:`Call` s to other agents, :class:`Signal` s from outside, :class:`Sleep` timers,
all of them or the :class:`FirstK` (each run wrapped by the app's :class:`Interceptor` s, if any;
its :class:`TaskObserver` s told of each :class:`HandlerFailure`),
the :class:`Worker` that serves them, and the :class:`Client` that submits tasks. The log is
``waystation.events``, its read models ``waystation.projections``, the schema's migrations
``waystation.migrations``; the command line is ``waystation.cli``.

Importing this package loads no broker or database driver: :class:`Client` and :class:`Worker`
(and with them aio-pika, SQLAlchemy and asyncpg) load when first named.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from waystation.agent import (
    AgentSpec,
    App,
    Handler,
    HandlerFailure,
    Interceptor,
    TaskContext,
    TaskObserver,
)
from waystation.events import (
    Call,
    CallResult,
    Complete,
    FirstK,
    Outcome,
    Pause,
    Signal,
    Sleep,
    Wait,
)
from waystation.policies import Backoff, Permanent, PolicyError, Rate, TimeLimitExceeded
from waystation.settings import Settings

if TYPE_CHECKING:
    from waystation.client import Client, TaskResult
    from waystation.runtime.worker import Worker

_LAZY = {"Client": ".client", "TaskResult": ".client", "Worker": ".runtime.worker"}
"""Names whose modules load the drivers: imported on first use."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AgentSpec",
    "App",
    "Backoff",
    "Call",
    "CallResult",
    "Client",
    "Complete",
    "FirstK",
    "Handler",
    "HandlerFailure",
    "Interceptor",
    "Outcome",
    "Pause",
    "Permanent",
    "PolicyError",
    "Rate",
    "Settings",
    "Signal",
    "Sleep",
    "TaskContext",
    "TaskObserver",
    "TaskResult",
    "TimeLimitExceeded",
    "Wait",
    "Worker",
]
