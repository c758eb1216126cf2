"""What a simulated run does, drawn from its seed: workers, tasks, peers and faults.

A :class:`Scenario` is a plain value, so a failing one can be shrunk (fewer tasks, fewer kinds of
fault) and printed as the command that replays it.

Besides peer calls, an orchestrator's pauses wait for signals and timers (issue 31), some of them
resuming on the first ``k`` results (``FirstK``); the world sends each signal at a moment drawn
around its wait (before it, while it is open, after it timed out, racing its timeout or the
task's cancel, after the task finished, before the task has a stream), sometimes twice under one
id, sometimes with a payload that does not fit the agent's model. These are drawn from a
generator of their own (``<seed>:waits``), so that every seed draws everything else as before.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Literal

__all__ = ["FAULT_KINDS", "SIGNAL_WHEN", "Scenario", "SignalSpec", "TaskSpec"]

Peer = Literal["researcher", "oracle"]
"""``researcher``: a Waystation agent served by the workers; ``oracle``: a plain AMQP peer."""
WaitKind = Literal["researcher", "oracle", "signal", "sleep"]
"""A wait of a pause: a call to a peer (with its ``x``), a signal (``x``: the index of its name,
``go<x>``) or a timer (``x``: its seconds)."""
SignalWhen = Literal[
    "no-stream", "early", "on-time", "late", "racing-timeout", "racing-cancel", "finished"
]
SIGNAL_WHEN: tuple[SignalWhen, ...] = (
    "no-stream",
    "early",
    "on-time",
    "on-time",
    "late",
    "racing-timeout",
    "racing-cancel",
    "finished",
)
"""When a signal is sent, against its wait: ``no-stream`` at once after its task is submitted
(before its first pause, most often: undeliverable); ``early`` once the pause before its wait's
is recorded (kept for its wait); ``on-time`` while its wait is open; ``late`` after its wait's
deadline (kept for a later wait on its name, or refused, the task finished); ``racing-timeout``
within a fraction of a second of its wait's deadline; ``racing-cancel`` of its task's cancel;
``finished`` once its task has finished in the log (refused) or answered without one."""
SIGNAL_NAMES = ("go0", "go1", "go2")
"""Names a signal may have; the orchestrator waits for the first two only (``go2`` is only ever
kept)."""
Bad = Literal["nan", "inf", "nul", "deep", "object"]
"""Outcomes a handler can return that no log can store (they used to be retried as if
transient, to the delivery limit)."""

FAULT_KINDS = (
    "crash",
    "storage",
    "drop",
    "duplicate",
    "latency",
    "skew",
    "cancel",
    "handler",
    "refuse",
    "hostile",
    "signals",
)
Hostile = Literal["not-utf8-id", "deep-headers", "odd-header-bad-json", "unknown-type-tag"]
"""Metadata no client library should write, sent raw to an agent's queue (``hostile``)."""
HOSTILE: tuple[Hostile, ...] = (
    "not-utf8-id",
    "deep-headers",
    "odd-header-bad-json",
    "unknown-type-tag",
)
REFUSED_RETRY = 60.0
"""The workers' ``refused_retry_seconds`` here: a result refused longer is dead-lettered."""
MAX_MESSAGE = 32 * 1024
"""The workers' ``max_message_bytes`` here; a broker limit drawn below it makes some results
sendable to the workers and not to the broker (``too-large``)."""


@dataclass(frozen=True)
class SignalSpec:
    """A signal the world sends to a task (``signals``)."""

    signal_id: str
    name: str
    pause: int
    """The pause whose wait on ``name`` it is meant for (``when`` counts from it)."""
    when: SignalWhen
    delay: float
    """Seconds after the moment ``when`` names (negative: before it, when racing)."""
    valid: bool = True
    """Whether its payload fits the agent's model of the signal (``{"n": int}``)."""
    copies: int = 1
    """How many times it is sent under its one id (a sender that retried)."""
    spread: float = 0.0
    """Seconds between its copies."""

    @property
    def payload(self) -> dict[str, object]:
        n = int(self.signal_id.rsplit("-", 1)[1])
        return {"n": n} if self.valid else {"n": f"{n} or so"}


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    agent: Literal["orchestrator", "researcher"]
    at: float
    """Seconds after the start when the publisher submits it."""
    rounds: tuple[tuple[tuple[WaitKind, int], ...], ...] = ()
    """An orchestrator's waits, round by round: (peer, x), (``signal``, name) or (``sleep``,
    seconds)."""
    until: tuple[int | None, ...] = ()
    """Each round's ``FirstK``, if it has one (None, or no entry: it waits for every result)."""
    signals: tuple[SignalSpec, ...] = ()
    """The signals the world sends to it (``signals``)."""
    timeout: float = 10.0
    fails: int = 0
    """Runs of each step whose handler raises before one succeeds."""
    slow: float = 0.0
    """Seconds each handler run takes."""
    bad: Bad | None = None
    cancel_at: float | None = None
    """Seconds after the start when a canceller cancels it."""
    gone: bool = False
    """Its publisher's reply queue no longer exists when the answer comes (such an answer used
    to re-run its handler)."""
    full_until: float | None = None
    """Its publisher's reply queue rejects publishes (``x-overflow: reject-publish``) and is full
    until this many seconds after the start, when its publisher drains it (``refuse``)."""
    big: int = 0
    """Bytes of padding in its final result (``refuse``): over ``MAX_MESSAGE`` it fails at once
    (``MessageTooLarge``); under it and over the broker's limit it is refused (``too-large``)."""
    odd_header: bool = False
    """Submitted raw, with a header that is a long string not UTF-8 (``hostile``): its copies (a
    retry, a dead letter) must carry it."""
    permanent: bool = False
    """An orchestrator whose first resumed run raises ``Permanent``: it fails, never runs again."""

    @property
    def x(self) -> int:
        """A researcher task's input."""
        return int(self.task_id.rsplit("-", 1)[1])


@dataclass(frozen=True)
class Scenario:
    seed: int
    workers: int = 2
    tasks: tuple[TaskSpec, ...] = ()
    faults: frozenset[str] = frozenset(FAULT_KINDS)
    resume_in_place: bool = True
    audit_all_tasks: bool = False
    counting: Literal["classic", "4.3"] = "classic"
    delivery_limit: int = 4
    storage_failure_rate: float = 0.0
    crash_rate: float = 0.0
    max_crashes: int = 0
    drops: tuple[float, ...] = ()
    """When a worker's broker connection drops (seconds after the start)."""
    duplicate_rate: float = 0.0
    skews: tuple[float, ...] = field(default=())
    nack_rate: float = 0.0
    """Share of publishes the broker nacks of itself (``refuse``)."""
    broker_max_bytes: int | None = None
    """The broker's ``max_message_size`` (``refuse``; None: no limit)."""
    hostile: tuple[tuple[float, str, Hostile], ...] = ()
    """Raw messages of hostile metadata: (when, to which agent's queue, what) (``hostile``)."""

    @classmethod
    def generate(cls, seed: int) -> Scenario:
        scenario = cls._generate(seed)
        # the broker saying no and hostile publishers, then signals and timers, each drawn from
        # a generator of their own so that everything else each seed draws stays as it was
        scenario = scenario._with_refusals(random.Random(f"{seed}:refusals"))
        return scenario._with_waits(random.Random(f"{seed}:waits"))

    def _with_waits(self, rng: random.Random) -> Scenario:
        if rng.random() >= 0.4:
            return self
        return replace(
            self,
            tasks=tuple(
                _with_waits(rng, task)
                if task.agent == "orchestrator" and task.rounds and rng.random() < 0.7
                else task
                for task in self.tasks
            ),
        )

    def _with_refusals(self, rng: random.Random) -> Scenario:
        refusing = rng.random() < 0.3
        hostile = rng.random() < 0.25
        tasks = tuple(
            replace(
                task,
                full_until=(
                    rng.choice((rng.uniform(3, 30), rng.uniform(70, 150)))
                    if refusing and not task.gone and rng.random() < 0.25
                    else None
                ),
                big=(
                    rng.choice((20 * 1024, 40 * 1024))
                    if refusing and task.agent == "orchestrator" and rng.random() < 0.15
                    else 0
                ),
                odd_header=hostile and rng.random() < 0.3,
                permanent=task.agent == "orchestrator" and bool(task.rounds) and rng.random() < 0.1,
            )
            for task in self.tasks
        )
        return replace(
            self,
            tasks=tasks,
            nack_rate=rng.choice((0.0, 0.02, 0.1)) if refusing else 0.0,
            broker_max_bytes=rng.choice((None, 16 * 1024)) if refusing else None,
            hostile=tuple(
                (
                    rng.uniform(0, 20),
                    rng.choice(("orchestrator", "researcher", "orchestrator.replies")),
                    rng.choice(HOSTILE),
                )
                for _ in range(rng.randint(1, 4) if hostile else 0)
            ),
        )

    @classmethod
    def _generate(cls, seed: int) -> Scenario:
        rng = random.Random(seed)
        if rng.random() < 0.1:
            return cls._deadline_storm(seed, rng)
        workers = rng.randint(1, 3)
        tasks = tuple(_task(rng, seed, n) for n in range(rng.randint(1, 4)))
        return cls(
            seed=seed,
            workers=workers,
            tasks=tasks,
            resume_in_place=rng.random() < 0.7,
            audit_all_tasks=rng.random() < 0.2,
            counting=rng.choice(("classic", "4.3")),
            delivery_limit=rng.randint(2, 4),
            storage_failure_rate=rng.choice((0.0, 0.05, 0.2)),
            crash_rate=rng.choice((0.0, 0.02, 0.05)),
            max_crashes=rng.randint(0, 3),
            drops=tuple(sorted(rng.uniform(0, 20) for _ in range(rng.randint(0, 2)))),
            duplicate_rate=rng.choice((0.0, 0.0, 0.05)),
            skews=tuple(rng.uniform(-2.0, 2.0) for _ in range(workers)),
        )

    @classmethod
    def _deadline_storm(cls, seed: int, rng: random.Random) -> Scenario:
        """One worker, short deadlines that a slow peer often misses, and slow handlers run in
        place across other tasks' deadlines: sweeps, timeouts and resumes all at once."""
        tasks = tuple(
            TaskSpec(
                f"s{seed}-o{n}",
                "orchestrator",
                rng.uniform(0, 3),
                rounds=tuple(
                    tuple(
                        (rng.choice(("researcher", "oracle")), rng.randint(1, 9))
                        for _ in range(rng.randint(1, 2))
                    )
                    for _ in range(rng.randint(1, 2))
                ),
                timeout=rng.choice((2.0, 3.0, 5.0)),
                slow=rng.choice((0.0, 12.0, 20.0)),
            )
            for n in range(rng.randint(2, 5))
        )
        return cls(
            seed=seed,
            workers=1,
            tasks=tasks,
            resume_in_place=True,
            skews=(rng.uniform(-2.0, 2.0),),
        )

    def without(self, kind: str) -> Scenario:
        """This scenario with one kind of fault turned off (for shrinking)."""
        return replace(self, faults=self.faults - {kind})

    def only_tasks(self, task_ids: set[str]) -> Scenario:
        return replace(self, tasks=tuple(t for t in self.tasks if t.task_id in task_ids))

    def has(self, kind: str) -> bool:
        return kind in self.faults


def _task(rng: random.Random, seed: int, n: int) -> TaskSpec:
    at = rng.uniform(0, 5)
    cancel_at = at + rng.uniform(-1, 12) if rng.random() < 0.15 else None
    gone = rng.random() < 0.05
    if rng.random() < 0.2:
        return TaskSpec(
            f"s{seed}-r{n}-{rng.randint(1, 9)}",
            "researcher",
            at,
            fails=rng.choice((0, 0, 1, 5)),
            slow=rng.choice((0.0, 0.0, 0.5)),
            cancel_at=cancel_at,
            gone=gone,
        )
    rounds = tuple(
        tuple(
            (rng.choice(("researcher", "researcher", "oracle")), rng.randint(1, 9))
            for _ in range(rng.randint(1, 3))
        )
        for _ in range(rng.randint(1, 2))
    )
    return TaskSpec(
        f"s{seed}-o{n}",
        "orchestrator",
        at,
        rounds=rounds,
        timeout=rng.choice((3.0, 3.0, 10.0, 30.0)),
        fails=rng.choice((0, 0, 0, 1, 2, 9)),
        slow=rng.choice((0.0, 0.0, 0.2, 4.0, 15.0)),
        bad=rng.choice((None,) * 12 + ("nan", "inf", "nul", "deep", "object")),
        cancel_at=cancel_at,
        gone=gone,
    )


def _with_waits(rng: random.Random, task: TaskSpec) -> TaskSpec:
    """``task`` with signals and timers among its calls, some rounds resuming on ``FirstK``,
    and the signals the world sends it."""
    rounds: list[tuple[tuple[WaitKind, int], ...]] = []
    until: list[int | None] = []
    for calls in task.rounds:
        waits: list[tuple[WaitKind, int]] = list(calls)
        for _ in range(rng.choice((0, 1, 1, 2, 3))):
            wait: tuple[WaitKind, int] = (
                ("signal", rng.randint(0, 1))
                if rng.random() < 0.65
                else ("sleep", rng.choice((0, 1, 3, 8, 20)))
            )
            waits.insert(rng.randint(0, len(waits)), wait)
        rounds.append(tuple(waits))
        until.append(
            rng.randint(1, len(waits) - 1) if len(waits) > 1 and rng.random() < 0.35 else None
        )
    signals = []
    for pause, waits in enumerate(rounds, start=1):
        for kind, x in waits:
            if kind == "signal" and rng.random() < 0.85:
                signals.append(_signal(rng, task, len(signals), f"go{x}", pause))
    if rng.random() < 0.15:  # a signal nothing waits for: kept to the end
        signals.append(_signal(rng, task, len(signals), "go2", 1))
    return replace(task, rounds=tuple(rounds), until=tuple(until), signals=tuple(signals))


def _signal(rng: random.Random, task: TaskSpec, n: int, name: str, pause: int) -> SignalSpec:
    when = rng.choice(SIGNAL_WHEN)
    delay = {
        "no-stream": rng.uniform(0.0, 0.5),
        "early": rng.uniform(0.0, 2.0),
        "on-time": rng.uniform(0.0, 0.9 * task.timeout),
        "late": rng.uniform(0.2, 5.0),
        "racing-timeout": rng.uniform(-0.3, 0.3),
        "racing-cancel": rng.uniform(-0.3, 0.3),
        "finished": rng.uniform(0.0, 2.0),
    }[when]
    return SignalSpec(
        signal_id=f"{task.task_id}-sig{n}-{rng.randint(1, 9)}",
        name=name,
        pause=pause,
        when=when,
        delay=delay,
        valid=rng.random() < 0.85,
        copies=rng.choice((1, 1, 1, 2, 3)),
        spread=rng.choice((0.0, rng.uniform(0.0, 3.0))),
    )
