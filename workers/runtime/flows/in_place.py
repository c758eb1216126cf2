"""The run step of a reply that resumes its task: the resumed handler runs at once, in place.

The worker that records a pause's last reply would otherwise append ``TaskResumed`` with a resume
message, and some instance would take that message, read the stream again and run the handler.
Run here instead, between deciding and appending (``Recorder.append_decision``, ``run_resumed``),
the run's outcome joins the claim's append: one statement, no resume message, no second read
(docs/performance.md). It runs under the stream's lock, since the append it joins is made at the
version the decision read; a conflict (a cancel or a timeout from another instance meanwhile)
decides again, and runs it again only if the task still resumes.
"""

from __future__ import annotations

import time

from waystation.agent import HandlerFailure
from waystation.events import (
    DomainEvent,
    InvalidTransition,
    NewEvent,
    Pause,
    TaskResumed,
    TaskState,
    decide_failure,
    fold,
)
from waystation.events.chain import recorded_events
from waystation.policies import Permanent
from waystation.runtime.decisions import Extension
from waystation.runtime.flows.base import Steps, error_of, resume_context

__all__ = ["run_in_place"]


async def run_in_place(
    steps: Steps,
    state: TaskState,
    events: list[DomainEvent],
    made: list[NewEvent],
) -> Extension | None:
    """Run the resumed handler now, on the instance that records the pause's last reply, so
    that its outcome joins the same append.

    None leaves the decision as it was (``TaskResumed`` and a resume message, which any instance
    serving the agent takes): when resuming in place is off, when this worker does not serve
    the task's agent, or when the agent has pool limits (its resumed run must take its slots,
    and wait in the broker when they are full, as every run of it does:
    ``waystation.runtime.limits``). A run that fails is judged by the agent's policy, as any run is:
    an error that trying again cannot help (``Permanent``, an outcome that can never be recorded),
    or an agent that allows no retry, fails the task in this same append; otherwise the decision
    stays, and its resume message counts that failed run and waits the agent's first backoff in the
    broker, so that the retries and the final failure follow the resume path within the agent's
    attempts.
    """
    if not (steps.settings.resume_in_place and events and isinstance(events[-1], TaskResumed)):
        return None
    spec = steps.app.agents.get(state.agent or "")
    if spec is None or spec.limited:
        return None
    decided_at = steps.clock()
    # the decision's events as they will be appended (``made``): the run sees what is recorded
    resumed = fold(
        state.task_id,
        recorded_events(state.task_id, state.version, made, state.last_hash),
        start=state,
    )
    try:
        outcome = await steps.run_handler(spec, resume_context(spec, resumed))
        returned_at = time.perf_counter()
        steps.faults.hit("resume.in-place")
        following = steps.decide_outcome(resumed, outcome, spec)
    except Exception as error:
        # the first run of this step: the agent's policy decides, as for any other run
        attempts = spec.attempts(steps.settings.delivery_limit)
        # trying again cannot help, or the agent allows no retry: fail now, in this append
        final = isinstance(error, (InvalidTransition, Permanent)) or attempts <= 1
        delay = None if final else spec.backoff.delay(1)
        steps.observer.on_failure(
            HandlerFailure(
                task_id=state.task_id,
                agent=spec.name,
                attempt=1,
                attempts=attempts,
                will_retry=not final,
                error=error,
                pause=resumed.pause,
                retry_in=delay,
            )
        )
        if delay is None:
            return Extension(
                [*events, *decide_failure(resumed, error_of(error))],
                checkpoint_started=None,
                resumed_at=decided_at,
            )
        # a resume message retries it, counting this failed run
        steps.observer.count("resumes_handed_over")
        return Extension(
            events,
            checkpoint_started=None,
            resumed_at=None,
            failed_runs=1,
            retry_delay=delay,
        )
    return Extension(
        [*events, *following],
        checkpoint_started=returned_at if isinstance(outcome, Pause) else None,
        resumed_at=decided_at,
    )
