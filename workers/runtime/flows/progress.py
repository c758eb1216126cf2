"""A progress message: a peer still working on a call moves the call's deadline (G6)."""

from __future__ import annotations

import uuid
from typing import Any

from waystation.brokers.port import Delivery
from waystation.events import decide_extension
from waystation.runtime.flows.base import Steps
from waystation.runtime.flows.reply import subtask_of
from waystation.runtime.recorder import Cause
from waystation.runtime.verdicts import Verdict, ack, dead

__all__ = ["handle_progress"]


async def handle_progress(steps: Steps, delivery: Delivery, body: Any) -> Verdict:
    found = subtask_of(delivery)
    if isinstance(found, Verdict):
        return found
    task_id, subtask = found
    extend_by = body.get("extend_by") if isinstance(body, dict) else None
    if not isinstance(extend_by, (int, float)) or isinstance(extend_by, bool) or extend_by <= 0:
        return dead("wrong-shape", 'a progress body is {"extend_by": <seconds > 0>}')
    applied = await steps.recorder.append_decision(
        task_id,
        lambda state: decide_extension(
            state,
            subtask,
            extend_by=float(extend_by),
            now=steps.clock(),
            max_duration=steps.settings.max_call_duration,
        ),
        key=lambda _: f"progress:{subtask}:{delivery.message_id or uuid.uuid4()}",
        cause=Cause.of(delivery),
        step="progress",
    )
    if not applied.state.exists:
        return dead("unknown-task", f"no task {task_id!r} in the log")
    steps.observer.count("deadlines_extended" if applied.events else "progress_ignored")
    return ack()
