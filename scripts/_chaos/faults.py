"""The chaos run's faults, as planned (:func:`_chaos.plan.plan_faults`): SIGKILLs of a random
worker (a replacement starts at once), ``rabbitmqctl close_all_connections`` in the vhost and
fast stops of the PostgreSQL cluster, each once every worker answers ``/healthz`` and recorded
with the results in, the tasks in flight and the victim's messages in its handlers. And the
hostile publisher: content headers no client library writes, to the agents' queues while tasks
are submitted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aiormq.exceptions

from scripts.lab.harness.broker import (
    broker_connections,
    close_all_broker_connections,
    publish_raw_properties,
)

from . import HEALTHY_WITHIN, HOSTILE_ANSWERS
from .hostile import HostileSent, hostile_message, hostile_plan
from .plan import PlannedFault
from .sample import read_counters
from .setup import Chaos

HOSTILE_TRIES = 10


async def inject(chaos: Chaos, plan: list[PlannedFault]) -> None:
    """Each fault of ``plan`` in turn, once its results are in and every worker is healthy."""
    assert chaos.collector is not None
    try:
        actions: dict[str, Callable[[Chaos, dict[str, Any]], Awaitable[str]]] = {
            "kill": kill,
            "close": close_connections,
            "pg-restart": restart_postgresql,
        }
        for number, fault in enumerate(plan, 1):
            await chaos.collector.wait_answered(fault.after_results)
            await asyncio.sleep(fault.delay)
            unhealthy = await chaos.wait_healthy()
            if unhealthy:
                chaos.fail(
                    f"workers {unhealthy} not healthy {HEALTHY_WITHIN:.0f}s after the last "
                    f"fault; {len(plan) - number + 1} faults not injected"
                )
                return
            done = chaos.results_in()
            record: dict[str, Any] = {
                "kind": fault.kind,
                "at_s": round(chaos.elapsed(), 2),
                "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "results_in": done,
                "submitted": chaos.submitted,
                "tasks_in_flight": chaos.window_submitted - done,
            }
            what = await actions[fault.kind](chaos, record)
            chaos.faults.append(record)
            chaos.say(
                f"fault {number:>2}/{len(plan)} {fault.kind}: {what}; at {done} results, "
                f"{record['tasks_in_flight']} tasks in flight"
            )
    finally:
        chaos.faults_done.set()


async def kill(chaos: Chaos, record: dict[str, Any]) -> str:
    """SIGKILL a random worker among those with messages in their handlers right now (any
    worker when none has), and start its replacement."""
    handling = [(await chaos.health(w)).in_flight or 0 for w in chaos.slots]
    busy = [slot for slot, count in enumerate(handling) if count > 0]
    slot = chaos.victims.choice(busy or list(range(len(chaos.slots))))
    victim = chaos.slots[slot]
    pid = victim.pid
    await read_counters(chaos, victim)  # its last counters, or they die with it
    victim.kill()
    chaos.retired.append(victim)
    replacement = chaos.start_worker(slot)
    record.update(
        victim=victim.name,
        pid=pid,
        victim_messages_in_handlers=handling[slot],
        replacement=replacement.name,
    )
    return (
        f"SIGKILL {victim.name} (pid {pid}, {handling[slot]} messages in its handlers), "
        f"started {replacement.name}"
    )


async def close_connections(chaos: Chaos, record: dict[str, Any]) -> str:
    connections = await broker_connections(chaos.vhost)
    in_handlers = [(await chaos.health(w)).in_flight for w in chaos.slots]
    await close_all_broker_connections(chaos.vhost)
    record.update(
        connections_closed=len(connections),
        messages_in_handlers=sum(n or 0 for n in in_handlers),
    )
    return (
        f"closed all {len(connections)} connections of the vhost "
        f"({sum(n or 0 for n in in_handlers)} messages in the workers' handlers)"
    )


async def restart_postgresql(chaos: Chaos, record: dict[str, Any]) -> str:
    assert chaos.cluster is not None
    before = chaos.results_in()
    stopping = time.monotonic()
    try:
        await chaos.cluster.stop()
        stopped = time.monotonic()
        # the outage itself: PostgreSQL stays down this long, whatever the workers do
        await asyncio.sleep(chaos.args.pg_down)
    finally:
        await chaos.cluster.ensure_running()
    running = time.monotonic()
    record.update(
        stop_took_s=round(stopped - stopping, 2),
        down_s=round(running - stopped, 2),
        results_while_down=chaos.results_in() - before,
    )
    return (
        f"stopped the cluster at {record['at_s']:.1f}s (fast, took {stopped - stopping:.1f}s), "
        f"down {running - stopped:.1f}s, running again"
    )


async def publish_hostile(chaos: Chaos) -> None:
    """``--hostile-rate`` hostile messages a second to the agents' task queues, while tasks
    are submitted (:func:`_chaos.hostile.hostile_message`); each kind in turn."""
    rate = chaos.args.hostile_rate
    if rate <= 0:
        return
    queues = [chaos.names.tasks("orchestrator"), chaos.names.tasks("researcher")]
    number = 0
    while chaos.submitting:
        kind = hostile_plan(number + 1, chaos.args.seed)[-1]
        sent = HostileSent(f"hostile-{chaos.args.seed}-{number}", kind, queues[number % 2])
        chaos.hostile.append(sent)
        await send_hostile(chaos, sent)
        number += 1
        await asyncio.sleep(1 / rate)


async def send_hostile(chaos: Chaos, sent: HostileSent) -> None:
    """Publish one hostile message; again (the same tag) when something other than the
    broker's refusal of it got in the way (a connection closed by a fault)."""
    properties, body = hostile_message(sent.kind, sent.tag, HOSTILE_ANSWERS)
    while sent.tries < HOSTILE_TRIES:
        sent.tries += 1
        try:
            await asyncio.wait_for(
                publish_raw_properties(chaos.amqp_url, sent.queue, body, properties), 30
            )
            sent.outcome = "routed"
            return
        except aiormq.exceptions.ConnectionInternalError as refused:
            # 541: RabbitMQ could not parse the header and closed the connection
            sent.outcome = "refused"
            sent.errors.append(f"{type(refused).__name__}: {refused}")
            return
        except Exception as error:
            sent.outcome = "error"
            sent.errors.append(f"{type(error).__name__}: {error}"[:300])
            await asyncio.sleep(1.0)
