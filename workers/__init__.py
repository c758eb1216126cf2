"""Waystation's worker runtime: the handler API, the worker, the publisher client.

Depends on ``events``; nothing depends on it but the composition root (``workers.cli``).
"""

from events import Call, CallResult, Complete, Outcome, Pause

from .agent import AgentSpec, App, Handler, TaskContext
from .client import Client, TaskResult
from .policies import Backoff, Permanent, PolicyError, Rate, TimeLimitExceeded
from .runtime import Worker
from .settings import Settings

__all__ = [
    "AgentSpec",
    "App",
    "Backoff",
    "Call",
    "CallResult",
    "Client",
    "Complete",
    "Handler",
    "Outcome",
    "Pause",
    "Permanent",
    "PolicyError",
    "Rate",
    "Settings",
    "TaskContext",
    "TaskResult",
    "TimeLimitExceeded",
    "Worker",
]
