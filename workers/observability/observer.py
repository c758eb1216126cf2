"""What a worker tells about itself: one interface for its counters and its Prometheus metrics.

Every path of the worker reports to an :class:`Observer` once (``observer.dead_letter(reason)``)
instead of bumping a counter and a metric side by side. The observer keeps the plain counters a
test or a benchmark reads (:class:`WorkerStats`, written to ``WAYSTATION_STATS_FILE`` when the
worker stops) and updates the Prometheus series (``waystation.observability.metrics``).

A failed run of a handler is told to :meth:`Observer.on_failure` once: it is logged with its
traceback (WARNING when the task is tried again, ERROR when it fails) and passed on to the app's
observers (``App(observers=[...])``, ``waystation.agent.TaskObserver``), whose mistakes are
logged and never reach the worker.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from waystation.agent import HandlerFailure, TaskObserver
from waystation.events import DomainEvent, TaskState
from waystation.observability import tracing
from waystation.observability.metrics import Metrics

__all__ = ["FINISHED", "Observer", "WorkerStats"]

log = logging.getLogger(__name__)

FINISHED = {"TaskCompleted": "completed", "TaskFailed": "failed", "TaskCancelled": "cancelled"}
"""Terminal event types, and the status each one gives a task."""

CHECKPOINT_SAMPLES = 100_000
"""Checkpoint latencies kept for the stats file (the most recent; the histogram has them all)."""


@dataclass
class WorkerStats:
    """Counters, and the most recent checkpoint latencies, that a test or a benchmark reads."""

    counters: dict[str, int] = field(default_factory=dict)
    checkpoint_seconds: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=CHECKPOINT_SAMPLES)
    )

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def to_json(self) -> dict[str, Any]:
        return {"counters": self.counters, "checkpoint_seconds": list(self.checkpoint_seconds)}


class Observer:
    """Counts what a worker does, in its stats and its metrics at once."""

    def __init__(
        self,
        metrics: Metrics | None = None,
        stats: WorkerStats | None = None,
        observers: Iterable[TaskObserver] = (),
    ) -> None:
        self.metrics = metrics or Metrics()
        self.stats = stats or WorkerStats()
        self.observers: tuple[TaskObserver, ...] = ()
        self.watch(observers)
        self._series: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def watch(self, observers: Iterable[TaskObserver]) -> None:
        """Tell ``observers`` too (each once, however often it is given) of what happens."""
        for observer in observers:
            if not any(observer is known for known in self.observers):
                self.observers = (*self.observers, observer)

    def _series_of(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: prometheus_client checks the labels and
        takes a lock on every call, several times per message on the hot path (~1% of a
        worker's CPU). A series, once made, stays (nothing here removes one)."""
        key = (metric, labels)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = metric.labels(*labels)
        return series

    def count(self, name: str, n: int = 1) -> None:
        """A counter of the stats alone (no metric of its own)."""
        self.stats.count(name, n)

    # ---- messages ------------------------------------------------------------------------------

    def in_flight(self, count: Callable[[], int]) -> None:
        """The in-flight gauge reads ``count()`` when scraped (nothing to do per message)."""
        self.metrics.in_flight.set_function(count)

    def handled(self, agent: str, kind: str, disposition: str) -> None:
        self._series_of(self.metrics.messages, agent, kind, disposition).inc()

    def settled(self, disposition: str, checkpoint_seconds: float | None) -> None:
        self.stats.count(f"settled_{disposition}")
        if checkpoint_seconds is not None:
            self.stats.checkpoint_seconds.append(checkpoint_seconds)
            self.metrics.checkpoint.observe(checkpoint_seconds)

    def dead_letter(self, reason: str) -> None:
        self.stats.count(f"dead_letter.{reason}")
        self.metrics.dead_letters.labels(reason).inc()

    def undelivered(self, agent: str) -> None:
        """A result of ``agent`` whose publisher's reply queue was gone (it did not wait)."""
        self.stats.count("results_undelivered")
        self.metrics.results_undelivered.labels(agent).inc()

    def duplicate(self, what: str) -> None:
        """A redelivery or re-run recognised as already recorded; ``what`` names the case."""
        self.stats.count(what)
        self.metrics.duplicates.inc()

    def outage(self, service: str) -> None:
        self.stats.count(f"{'store' if service == 'database' else service}_unavailable")
        self.metrics.outages.labels(service).inc()

    def unreadable(self) -> None:
        self.metrics.unreadable.inc()

    # ---- handlers --------------------------------------------------------------------------------

    def on_failure(self, failure: HandlerFailure) -> None:
        """A run of a handler failed: logged once, with its traceback and, as fields of a JSON
        line, its task, agent and attempt; then each observer of the app is told."""
        if failure.will_retry:
            level, then = logging.WARNING, f"; retrying in {failure.retry_in or 0:.2f}s"
        else:
            level, then = logging.ERROR, "; the task fails"
        log.log(
            level,
            "task %s: the handler of %s raised %s: %.200s (attempt %d of %d%s)%s",
            failure.task_id,
            failure.agent,
            type(failure.error).__name__,
            failure.error,
            failure.attempt,
            failure.attempts,
            f", resumed from pause {failure.pause}" if failure.pause else "",
            then,
            exc_info=failure.error,
            extra={
                "fields": {
                    "task_id": failure.task_id,
                    "agent": failure.agent,
                    "attempt": failure.attempt,
                    "attempts": failure.attempts,
                    "will_retry": failure.will_retry,
                    "pause": failure.pause,
                }
            },
        )
        for observer in self.observers:
            try:
                observer.on_failure(failure)
            except Exception:  # an observer's mistake never changes what becomes of the task
                log.exception("observer %r failed in on_failure; ignored", observer)

    # ---- the log ------------------------------------------------------------------------------

    def appended(
        self, agent: str | None, events: Sequence[DomainEvent], state: TaskState | None = None
    ) -> None:
        """``events`` were appended to the task ``state`` (its spans too, when tracing)."""
        if state is not None:
            tracing.recorded(state, events)
        self.stats.count("events_appended", len(events))
        for event in events:
            self._series_of(self.metrics.events_appended, event.event_type).inc()
            status = FINISHED.get(event.event_type)
            if status is not None:
                self._series_of(self.metrics.tasks_finished, agent or "?", status).inc()

    def completed_unrecorded(self, state: TaskState) -> None:
        """A task completed without calls: answered, nothing recorded (G10)."""
        self.stats.count("tasks_completed_unrecorded")
        tracing.finished_unrecorded(state)

    def version_conflict(self) -> None:
        self.stats.count("version_conflicts")
        self.metrics.version_conflicts.inc()

    def resumed_in_place(self, seconds: float) -> None:
        self.stats.count("resumed_in_place")
        self.metrics.resume.observe(seconds)

    def resumed(self, seconds: float) -> None:
        self.metrics.resume.observe(seconds)

    def timeout(self, agent: str) -> None:
        self.stats.count("timeouts")
        self.metrics.timeouts.labels(agent).inc()

    # ---- pool limits ---------------------------------------------------------------------------

    def waited(self, agent: str, limit: str) -> None:
        """A run found ``limit`` (``concurrency`` or ``rate``) full: its task waits."""
        self.stats.count(f"limit_waits.{limit}")
        self.metrics.limit_waits.labels(agent, limit).inc()

    def leases_lost(self, count: int) -> None:
        """Concurrency slots this worker held that ran out before it renewed them."""
        self.stats.count("slot_leases_lost", count)
        self.metrics.leases_lost.inc(count)

    def refused(self, reason: str) -> None:
        self.stats.count("publish_refusals")
        self.metrics.publish_refusals.labels(reason).inc()

    def relayed(self, count: int) -> None:
        self.stats.count("outbox_relayed", count)
        self.metrics.outbox_relayed.inc(count)
