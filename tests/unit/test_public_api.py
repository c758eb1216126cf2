"""The public API is pinned: adding or removing a name from ``__all__`` is a deliberate change."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

EVENTS_API = [
    "AppendResult",
    "Call",
    "CallResult",
    "CancelledCall",
    "Complete",
    "DeadLettersReplayed",
    "DeadlineExtended",
    "DomainEvent",
    "EventMetadata",
    "EventStore",
    "EventStoreError",
    "ExpiredCall",
    "FirstK",
    "GENESIS_HASH",
    "IntegrityError",
    "InvalidTransition",
    "MAX_TASK_ID_BYTES",
    "MessageTooLarge",
    "NewEvent",
    "OPERATIONS_STREAM",
    "OutboxEntry",
    "OutboxMessage",
    "Outcome",
    "Pause",
    "PendingCall",
    "Position",
    "RecordedEvent",
    "ReplyIgnored",
    "ResultRecorded",
    "Signal",
    "SignalReceived",
    "SignalRefused",
    "Sleep",
    "StoreUnavailable",
    "SubtaskClaimed",
    "TaskCancelled",
    "TaskCompleted",
    "TaskFailed",
    "TaskPaused",
    "TaskResumed",
    "TaskStarted",
    "TaskState",
    "UnknownEvent",
    "UpcastError",
    "Upcasters",
    "VersionConflict",
    "Wait",
    "apply_delta",
    "canonical",
    "chain_hash",
    "decide_cancel",
    "decide_extension",
    "decide_failure",
    "decide_outcome",
    "decide_reply",
    "decide_signal",
    "decide_timeout",
    "event_id",
    "fold",
    "parse",
    "parse_subtask_id",
    "subtask_id",
]

WORKERS_API = [
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

PINNED = {"waystation.events": EVENTS_API, "waystation": WORKERS_API}


def module(name: str) -> ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_all_is_exactly_the_pinned_list(name: str) -> None:
    exported = module(name).__all__
    assert sorted(exported) == PINNED[name]
    assert len(set(exported)) == len(exported), "a name is exported twice"


@pytest.mark.parametrize(
    ("name", "attribute"),
    [(name, attribute) for name in sorted(PINNED) for attribute in PINNED[name]],
)
def test_every_exported_name_is_importable(name: str, attribute: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {name} import {attribute}", namespace)  # the statement a user writes
    assert namespace[attribute] is getattr(module(name), attribute)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_star_import_gives_exactly_all(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {name} import *", namespace)
    namespace.pop("__builtins__", None)
    assert sorted(namespace) == PINNED[name]


def test_the_handler_api_is_the_same_objects_in_both_packages() -> None:
    events, workers = module("waystation.events"), module("waystation")
    for shared in sorted(set(EVENTS_API) & set(WORKERS_API)):
        assert getattr(workers, shared) is getattr(events, shared), shared
