"""Hostile content headers against the real RabbitMQ and a real worker process (G9).

A raw AMQP client (``scripts/lab/fuzz``) publishes what client libraries refuse to write: properties
and header tables malformed in every way AMQP lets them be (short strings that are not UTF-8,
tables nested thousands deep, unknown type tags, lengths that lie, flag words bent), to
``<prefix>echo`` of a worker process of ``tests/apps/fuzz_target.py``. After each message:

* the broker refused it (recorded), or its fate is known: its handler ran (as often as its body
  asks), or it is a dead letter with a reason (any reason);
* the worker answers a normal task, on the broker connection it started with, holding nothing
  unsettled, and its log says nothing of a dropped connection or a delivery left unsettled;

and at the end the task queue is empty. The hypothesis run is derandomized, so every run sends
the same messages (``scripts/fuzz --examples 60 --only K`` sends example K again); the known
triggers are fixed cases. ``scripts/fuzz`` runs the same code for as long as you like.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from scripts.lab.fuzz.campaign import AGENT, Campaign, Outcome, report_failures, summary
from scripts.lab.fuzz.messages import FIXED, drafts
from scripts.lab.harness.database import fresh_database_url
from waystation import migrations
from waystation.settings import Settings

from ..support import Services, require

pytestmark = pytest.mark.integration

EXAMPLES = 60
"""Hypothesis examples of the bounded run: about 25 s here (a rabbitmqctl call after each)."""


def explain(outcomes: list[Outcome], end: list[str]) -> str:
    replays = "".join(
        f"\n{o.label}: scripts/fuzz --examples {EXAMPLES} --only {o.label[1:]}"
        for o in outcomes
        if not o.ok and o.label.startswith("#")
    )
    at_end = "".join(f"\nat the end: {problem}" for problem in end)
    return f"{report_failures(outcomes)}{at_end}{replays}\n\n{summary(outcomes)}"


@pytest_asyncio.fixture
async def fuzz_settings(
    services: Services, settings: Settings, extra_agents: list[str]
) -> AsyncIterator[Settings]:
    """The test's settings with a database of its own: a task id another test's log recorded
    would be answered from the log, not run."""
    require(
        services.rabbitmqctl,
        "the frame fuzzer (it asks the broker for the worker's connection and unsettled messages)",
    )
    extra_agents.append(AGENT)
    url = fresh_database_url(services.admin_database_url, "ws_fuzz_")
    await migrations.upgrade(url)
    yield settings.model_copy(update={"database_url": url})
    await migrations.drop_database(url)


async def test_hostile_content_headers_cost_the_worker_neither_its_connection_nor_a_message(
    fuzz_settings: Settings, tmp_path: Path
) -> None:
    sequence = drafts(EXAMPLES)
    async with Campaign(fuzz_settings, tmp_path, stop_at_first_failure=True) as campaign:
        for number, draft in enumerate(sequence):
            await campaign.send(campaign.message(draft, number), f"#{number}")
            if campaign.stopped:
                break
        end = await campaign.finish()
    outcomes = campaign.outcomes
    assert all(o.ok for o in outcomes) and not end, explain(outcomes, end)
    # the run reached every path: the broker refused some, the handler ran some, the worker
    # dead-lettered some
    fates = Counter(o.fate.split(" (")[0] for o in outcomes)
    assert len(outcomes) == len(sequence) >= EXAMPLES // 2, fates
    assert fates["refused by the broker"] and fates["ran"] and fates["dead-lettered"], fates


@pytest.mark.parametrize("case", list(FIXED))
async def test_a_known_trigger_costs_the_worker_neither_its_connection_nor_the_message(
    case: str, fuzz_settings: Settings, tmp_path: Path
) -> None:
    """Each known trigger, alone: the broker takes it, and the worker settles it (it runs, or
    it is dead-lettered with a reason: ``undecodable-metadata`` is expected of a message whose
    metadata cannot be decoded) on the connection it started with."""
    async with Campaign(fuzz_settings, tmp_path, stop_at_first_failure=True) as campaign:
        outcome = await campaign.send(campaign.message(FIXED[case], 0), case)
        end = await campaign.finish()
    assert outcome.verdict.accepted, outcome.report()
    assert outcome.ok and not end, explain([outcome], end)
