"""scripts/bench's pure parts: its options, the summary and table, the drivers, the RSS summary.

No services and no measuring: synthetic results go through :func:`_bench.report.summarise`, and
the drivers run against a fake parent.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from _bench.drive import BenchFailure, drive_count, drive_window  # noqa: E402
from _bench.memory import rss_summary  # noqa: E402
from _bench.report import REQUIRED_KEYS, print_report, summarise  # noqa: E402


def _bench_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_script", SCRIPTS / "bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _bench_script()


def _session(rate: float, **extra: Any) -> dict[str, Any]:
    """What one worker session reports (the keys the summary reads)."""
    return {
        "parents_per_s": rate,
        "latency_p50_ms": 1000 / rate,
        "latency_p99_ms": 2000 / rate,
        "checkpoint_p50_ms": None,
        "checkpoint_p99_ms": None,
        "messages_per_parent": 8.0,
        "db_transactions_per_parent": 8.5,
        "version_conflicts_per_parent": 0.3,
        "db_sessions_opened": 30,
        "worker_cpu_ms_per_parent": 8.0,
        "broker_cpu_ms_per_parent": 3.0,
        "bench_client_cpu_ms_per_parent": 0.5,
        "machine_cpu_ms_per_parent": 20.0,
        "broker_messages_per_parent": {"routed": 8.0, "delivered": 8.0, "redelivered": 0.0},
        "result_duplicates": 0,
        "worker_log_problems": 0,
        "worker_log_first_problems": [],
        "leftover_messages": {},
        **extra,
    }


def _run(rate: float, celery_rate: float | None) -> dict[str, Any]:
    run: dict[str, Any] = {
        "other_load_cores": 0.0,
        "throughput": _session(rate, checkpoint_p50_ms=150.0, checkpoint_p99_ms=500.0),
        "single": _session(70.0, checkpoint_p50_ms=1.5, checkpoint_p99_ms=6.0),
    }
    if celery_rate is not None:
        run["celery_throughput"] = _session(celery_rate, redis_commands_per_parent=80.0)
        run["celery_single"] = _session(60.0)
    return run


def _results(*, celery: bool = True) -> dict[str, Any]:
    samples = [
        {"seconds": 0, "parents_completed": 0, "rss_mb": {"w0": 90.0, "w1": 95}, "label": "start"},
        {"seconds": 5, "parents_completed": 500, "rss_mb": {"w0": 99.0, "w1": 96.0}},
        {"seconds": 9, "parents_completed": 900, "rss_mb": {"w0": 92, "w1": 97.5}, "label": "end"},
    ]  # fmt: skip
    point = {"latency_p50_ms": 10.0, "latency_p99_ms": 20.0, "worker_log_problems": 0}
    return {
        "machine": {"nproc": 2},
        "runs": [_run(r, c if celery else None) for r, c in ((90, 50), (100, 60), (130, 70))],
        "curve": {
            "in_flight": [1, 10],
            "window_s": 10.0,
            "warmup": "max(in flight, 50) completions before the window",
            "other_load_cores": [0.0, 0.0],
            "waystation": [
                {"in_flight": 1, "parents_per_s": 60.0, **point},
                {"in_flight": 10, "parents_per_s": 95.0, **point},
            ],
            "celery": [
                {"in_flight": 1, "parents_per_s": 70.0, **point},
                {"in_flight": 10, "parents_per_s": 90.0, **point},
            ]
            if celery
            else None,
            "chart": "bench-results/concurrency.png",
        },
        "memory": {
            "tasks": 100_000,
            "parents": 25_000,
            "warmup_parents": 1000,
            "in_flight": 100,
            "other_load_cores": 0.0,
            **rss_summary(samples),
            "parents_per_s": 95.0,
            "session": _session(95.0),
            "samples": samples,
        },
        "append": {
            "runs": [
                {"events_per_s": 40_000.0, "unbatched_events_per_s": 2000.0, "append_p50_ms": 15.0},
                {"events_per_s": 36_000.0, "unbatched_events_per_s": 2100.0, "append_p50_ms": 16.0},
            ]
        },
        "projection_rebuild": {
            "events_per_second": {"paused_tasks": {}, "agent_stats": {}},
            "runs": [
                {
                    "events_per_s": {"paused_tasks": 55_000.0, "agent_stats": 70_000.0},
                    "slowest_events_per_s": 55_000.0,
                },
                {
                    "events_per_s": {"paused_tasks": 59_000.0, "agent_stats": 58_000.0},
                    "slowest_events_per_s": 58_000.0,
                },
            ],
        },
        "duration_s": 600.0,
    }


def test_every_required_key_is_a_median_of_the_runs() -> None:
    args = bench.parse_args(["--compare", "celery"])
    summary = summarise(args, _results())

    assert set(REQUIRED_KEYS) <= summary.keys()
    assert all(summary[key] is not None for key in REQUIRED_KEYS)
    assert summary["parents_per_s"] == 100
    assert summary["celery_parents_per_s"] == 60
    assert summary["ratio_vs_celery"] == pytest.approx(100 / 60)
    assert summary["single_p50_ms"] == pytest.approx(1000 / 70)
    # the checkpoint's own cost comes from the one-at-a-time session, the loaded one apart
    assert summary["checkpoint_p50_ms"] == 1.5
    assert summary["checkpoint_p99_ms"] == 6.0
    assert summary["checkpoint_under_load_p50_ms"] == 150.0
    assert summary["checkpoint_under_load_p99_ms"] == 500.0
    assert summary["append_events_per_s"] == 38_000
    assert summary["rebuild_events_per_s"] == 56_500  # median of each run's slowest projection
    assert summary["rebuild_agent_stats_events_per_s"] == 64_000
    assert summary["rss_start_mb"] == 95.0  # the largest worker at the start sample
    assert summary["rss_end_mb"] == 97.5
    assert summary["rss_growth_mb"] == 2.5
    assert summary["rss_mid_mb"] == 99.0  # the sample at 500 of 900 parents
    assert summary["rss_second_half_growth_mb"] == 1.5  # w1: 96 -> 97.5 (w0 shrank)
    assert summary["memory_tasks"] == 100_000
    assert summary["memory_parents"] == 25_000
    assert summary["messages_per_parent"] == 8.0
    assert summary["messages_per_parent_minimum"] == 2 * 3 + 2
    assert summary["celery_redis_commands_per_parent"] == 80.0
    assert summary["warnings"] == []
    assert len(summary["runs"]) == 3


def test_the_table_says_which_checkpoint_is_which_and_shows_the_curve(
    capsys: pytest.CaptureFixture[str],
) -> None:
    summary = summarise(bench.parse_args(["--compare", "celery"]), _results())
    rows = {row["key"]: row for row in summary["table"]}
    assert rows["checkpoint_p50_ms"]["label"] == "checkpoint p50, one at a time"
    loaded = rows["checkpoint_under_load_p50_ms"]["label"]
    assert loaded == "checkpoint p50, under load (100 in flight)"
    assert rows["ratio_vs_celery"]["median_text"] == "1.67"
    assert rows["parents_per_s"]["per_run_text"] == "90.0, 100.0, 130.0"
    assert rows["ratio_vs_celery"]["per_run_text"] == "1.80, 1.67, 1.86"  # each run's own

    print_report(summary)
    out = capsys.readouterr().out
    assert "checkpoint p99, one at a time" in out
    assert "checkpoint p99, under load (100 in flight)" in out
    assert "memory: 100,000 tasks = 25,000 parents of 1+K tasks" in out
    assert "| celery" in out  # the curve table has the Celery columns
    assert "structural minimum is 2K+2 = 8" in out
    assert "RSS by parents completed: 0: 95.0, 500: 99.0, 900: 97.5" in out


def test_without_celery_or_other_modes_the_keys_are_null() -> None:
    args = bench.parse_args(["--only", "throughput"])
    results = _results(celery=False)
    for absent in ("curve", "memory", "append", "projection_rebuild"):
        del results[absent]
    for run in results["runs"]:
        run["single"] = None
    summary = summarise(args, results)

    assert set(REQUIRED_KEYS) <= summary.keys()
    assert summary["parents_per_s"] == 100
    for key in (
        "celery_parents_per_s",
        "ratio_vs_celery",
        "single_p50_ms",
        "checkpoint_p50_ms",
        "append_events_per_s",
        "rebuild_events_per_s",
        "rss_start_mb",
        "rss_end_mb",
    ):
        assert summary[key] is None, key
    assert "ratio_vs_celery" not in {row["key"] for row in summary["table"]}


def test_loaded_runs_and_log_problems_are_warned_about() -> None:
    results = _results()
    results["runs"][1]["other_load_cores"] = 0.9
    results["runs"][2]["throughput"]["worker_log_problems"] = 2
    results["runs"][2]["throughput"]["worker_log_first_problems"] = ["w0.log: ERROR boom"]
    warnings = summarise(bench.parse_args([]), results)["warnings"]
    assert any("0.90 cores" in w for w in warnings)
    assert any("worker log warnings/errors: 2" in w for w in warnings)
    assert any("ERROR boom" in w for w in warnings)


def test_options() -> None:
    args = bench.parse_args([])
    assert args.only == ["throughput", "single"]  # about ten minutes, with Celery beside them
    assert args.compare == "celery"
    assert bench.parse_args(["--compare", "none"]).compare is None
    assert bench.parse_args(["--only", "all"]).only == list(bench.MODES)
    assert args.curve_points == [1, 10, 100, 500]
    assert bench.parse_args(["--rebuild-only"]).only == ["rebuild"]
    assert bench.parse_args(["--only", "memory, throughput"]).only == ["throughput", "memory"]
    assert bench.parse_args(["--curve-points", "500,1,10"]).curve_points == [1, 10, 500]
    for wrong in (["--only", "throughput,speed"], ["--curve-points", "0,10"], ["--runs", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(wrong)
    with pytest.raises(SystemExit):  # fewer parents than the warm-up
        bench.parse_args(["--memory-tasks", "400", "--memory-warmup", "100"])


async def test_drive_count_runs_every_parent_with_the_parents_in_flight() -> None:
    running, most = 0, 0

    async def one() -> None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0)
        running -= 1

    _, latencies = await drive_count(one, 50, 7)
    assert len(latencies) == 50
    assert most == 7


async def test_drive_window_counts_inside_the_window_only() -> None:
    opened: list[str] = []

    async def one() -> None:
        await asyncio.sleep(0.001)

    window = await drive_window(
        one,
        4,
        warmup=8,
        seconds=0.05,
        on_open=lambda: opened.append("open"),
        on_close=lambda: opened.append("close"),
    )
    assert opened == ["open", "close"]
    assert window.warmup >= 8
    assert window.completed > 0
    assert window.completed + window.warmup <= window.total
    start, end = window.records[0][0], window.records[-1][1]
    assert all(start <= submitted <= done <= end for submitted, done in window.records)


async def test_a_wrong_result_stops_the_drivers() -> None:
    calls = 0

    async def one() -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        if calls == 5:
            raise BenchFailure("wrong result for parent n=5")

    with pytest.raises(BenchFailure, match="n=5"):
        await drive_count(one, 100, 3)
    with pytest.raises(BenchFailure, match="n=5"):
        calls = 0
        await drive_window(one, 3, warmup=10, seconds=5)


def test_rss_summary_per_worker_and_largest() -> None:
    samples = [
        {"parents_completed": 0, "rss_mb": {"a": 50.0, "b": 60.0}, "label": "start"},
        {"parents_completed": 40, "rss_mb": {"a": 80.0, "b": None}},
        {"parents_completed": 60, "rss_mb": {"a": 54.0, "b": 57.0}},
        {"parents_completed": 100, "rss_mb": {"a": 55.0, "b": 58.0}, "label": "end"},
    ]
    rss = rss_summary(samples)
    assert rss["rss_start_mb"] == 60.0
    assert rss["rss_end_mb"] == 58.0
    assert rss["rss_growth_mb"] == 5.0  # worker a: 50 -> 55
    assert rss["mid_parents_completed"] == 60  # the first sample at half the parents or more
    assert rss["rss_mid_mb"] == 57.0
    assert rss["rss_second_half_growth_mb"] == 1.0
    assert rss["per_worker"]["a"] == {
        "start_mb": 50.0,
        "mid_mb": 54.0,
        "end_mb": 55.0,
        "peak_mb": 80.0,
        "growth_mb": 5.0,
        "second_half_growth_mb": 1.0,
    }
    assert rss["per_worker"]["b"]["peak_mb"] == 60.0


def test_cpu_is_also_compared_with_celerys_run_by_run() -> None:
    """The machine's speed moves from run to run; each run's CPU per parent is set against
    Celery's in the same run, and the table gives the median of those ratios."""
    results = _results()
    for run, (ours, theirs) in zip(
        results["runs"], ((8.0, 16.0), (12.0, 15.0), (6.0, 10.0)), strict=True
    ):
        run["throughput"]["worker_cpu_ms_per_parent"] = ours
        run["celery_throughput"]["worker_cpu_ms_per_parent"] = theirs
        run["celery_throughput"]["machine_cpu_ms_per_parent"] = 2 * ours
    results["runs"][2]["celery_throughput"]["machine_cpu_ms_per_parent"] = None  # not measured
    summary = summarise(bench.parse_args(["--compare", "celery"]), results)
    rows = {row["key"]: row for row in summary["table"]}
    assert rows["worker_cpu_ratio_vs_celery"]["per_run_text"] == "0.50, 0.80, 0.60"
    # the median of the runs' ratios, not the ratio of the medians (8 / 15)
    assert summary["worker_cpu_ratio_vs_celery"] == pytest.approx(0.6)
    assert rows["worker_cpu_ratio_vs_celery"]["target"] == "≤0.56"
    assert rows["machine_cpu_ratio_vs_celery"]["per_run_text"] == "1.25, 0.83"
    without = summarise(bench.parse_args(["--compare", "none"]), _results(celery=False))
    assert without["worker_cpu_ratio_vs_celery"] is None
    assert "worker_cpu_ratio_vs_celery" not in {row["key"] for row in without["table"]}
