"""``scripts/chaos --quick`` end to end: a few dozen tasks through real worker processes while two
are SIGKILLed, every broker connection is closed once and PostgreSQL restarts once; the script
must exit 0 and its JSON must show nothing lost, wrong or recorded twice, and every fault landing
on work in flight. The full run (5,000 tasks, 24 faults) is too long for the suite; its latest
figures are in the README ("Chaos")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..support import ROOT, PostgresCluster, Services, require

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(240)
def test_the_quick_chaos_run_loses_nothing_and_records_nothing_twice(
    services: Services, tmp_path: Path
) -> None:
    require(services.rabbitmqctl, "the chaos run (connections closed in a vhost of its own)")
    PostgresCluster.serving(services.admin_database_url, "the chaos run (a scratch cluster)")
    figures_path = tmp_path / "chaos.json"
    run = subprocess.run(
        [sys.executable, "scripts/chaos.py", "--quick", "--json", str(figures_path)],
        cwd=ROOT,
        env={
            **os.environ,
            "WAYSTATION_AMQP_URL": services.amqp_url,
            # only to find the PostgreSQL version: the run makes a scratch cluster of its own
            "WAYSTATION_DATABASE_URL": services.admin_database_url,
        },
        capture_output=True,
        text=True,
        timeout=220,
    )
    output = f"{run.stdout}\n{run.stderr}"
    assert run.returncode == 0, output
    figures = json.loads(figures_path.read_text())
    assert figures["ok"] and not figures["failures"], output
    tasks = figures["options"]["tasks"]
    assert figures["tasks_submitted"] == tasks
    results = figures["results"]
    assert (results["answered"], results["missing"], results["wrong"]) == (tasks, 0, 0), output
    log = figures["log"]
    # one stream per task, plus one per researcher's task that was redelivered after a kill
    # (it records its completion: README, "Failures and dead letters")
    assert log["streams"] >= tasks and log["unexpected_streams"] == 0, output
    assert (
        log["tasks_not_completed_once"],
        log["pauses_resumed_twice"],
        log["pauses_recorded_twice"],
        log["subtasks_not_claimed_once"],
    ) == (0, 0, 0, 0), output
    assert figures["verify_exit"] == 0, output
    assert figures["rebuild_paused_tasks_check_exit"] == 0, output
    assert figures["rebuild_agent_stats_check_exit"] == 0, output
    assert figures["dead_letters"]["count"] == 0, output
    assert figures["faults_injected"] == {"kill": 2, "close": 1, "pg-restart": 1}, output
    assert all(fault["tasks_in_flight"] > 0 for fault in figures["faults"]), output
