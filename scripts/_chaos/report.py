"""The chaos run's report: its figures, printed as a table, and the verdict."""

from __future__ import annotations

from typing import Any

from . import SAMPLE_EVERY


def _left(figures: dict[str, Any]) -> str:
    return f": {figures['left_unsettled']}" if figures["unsettled"] else ""


def _seconds(age: float | None) -> str:
    return "empty" if not age else f"{age:.1f}s"


def _reasons(reasons: dict[str, Any]) -> str:
    return ", ".join(f"{reason} {count:g}" for reason, count in sorted(reasons.items())) or "none"


def print_figures(figures: dict[str, Any], failures: list[str], elapsed: float) -> None:
    results, log = figures["results"], figures["log"]
    dead = figures["dead_letters"]
    injected = figures["faults_injected"]
    kinds = figures["task_kinds"]
    by_kind = results["by_kind"]
    full = figures["full_queues"]
    hostile = figures["hostile"]
    options = figures["options"]
    refusals = figures["publish_refusals"]
    oldest = figures["outbox_oldest_s"]
    over_worker = by_kind.get("over-worker", {})
    over_broker = by_kind.get("over-broker", {})
    rows = [
        (
            "tasks submitted",
            f"{figures['tasks_submitted']} ({figures['submits_retried']} "
            "publishes retried after a connection close)",
        ),
        (
            "kinds of task",
            f"{kinds.get('normal', 0)} plain, {kinds.get('full-drained', 0)} through full "
            f"queues drained late, {kinds.get('full-never', 0)} through one never drained, "
            f"{kinds.get('over-worker', 0)} over the workers' limit, "
            f"{kinds.get('over-broker', 0)} over the broker's",
        ),
        (
            "tasks answered",
            f"{results['answered']} ({results['answered_by_result']} by a result, "
            f"{results['answered_by_dead_letter']} by their dead letter); "
            f"{results['messages']} result messages",
        ),
        (
            "lost",
            f"{figures['lost']} ({results['missing']} tasks without an answer, "
            f"{hostile['missing']} hostile messages taken and never dead-lettered)",
        ),
        (
            "stuck",
            f"{figures['stuck']} ({figures['tasks_unfinished_in_the_log']} tasks unfinished in "
            f"the log, {figures['paused_tasks_left']} left paused)",
        ),
        (
            "unsettled",
            f"{figures['unsettled']} (messages in queues, delivered and unacked, or in the "
            f"outbox at the end{_left(figures)})",
        ),
        ("wrong answers", results["wrong"]),
        (
            "duplicate results",
            f"{results['duplicates']} ({results['duplicates_redelivered_to_collector']} "
            f"redelivered to the collector, {results['duplicates_published_again']} "
            "published again by a worker)",
        ),
        (
            "answered through a full queue",
            f"{full['results_through_full_queues']} results through {full['drained_queues']} "
            f"queues drained {options['full_hold_s']:.0f}s late, "
            f"{full['answered_by_refused_dead_letter']} dead letters (refused) of the one "
            "never drained",
        ),
        (
            "publishes refused",
            f"{sum(refusals['metrics'].values()):.0f} ({_reasons(refusals['metrics'])}; "
            "waystation_publish_refusals_total of every worker)",
        ),
        (
            "outbox oldest row",
            f"{oldest['max_seen']:.1f}s at most (sampled every {SAMPLE_EVERY:.0f}s); "
            f"{_seconds(oldest['when_the_window_was_answered'])} when the window was answered, "
            f"{_seconds(oldest['at_end'])} at the end",
        ),
        (
            "oversized results",
            f"{over_worker.get('by_result', 0)} of {over_worker.get('tasks', 0)} answered "
            f"MessageTooLarge (over {options['max_message_bytes']} bytes), "
            f"{over_broker.get('by_result', 0)} of {over_broker.get('tasks', 0)} "
            f"undeliverable-result (over the broker's {options['broker_max_message_size']})",
        ),
        (
            "hostile messages",
            f"{hostile['sent']} sent: {hostile['dead_lettered']} dead-lettered "
            f"({_reasons(hostile['reasons'])}), {hostile['refused_by_rabbitmq']} refused by "
            f"RabbitMQ itself (541); {hostile['missing']} lost, {hostile['wrong_reason']} "
            "with another reason",
        ),
        (
            "hostile messages' publisher told",
            f"{sum(hostile['answered_with_error'].values())} errors "
            f"({_reasons(hostile['answered_with_error'])}); {hostile['wrong_answers']} wrong",
        ),
        ("tasks without exactly one terminal", log["tasks_not_completed_once"]),
        ("pauses resumed twice", log["pauses_resumed_twice"]),
        ("pauses recorded twice", log["pauses_recorded_twice"]),
        ("sub-tasks not claimed exactly once", log["subtasks_not_claimed_once"]),
        ("replies ignored (audit)", log["reply_ignored"] or 0),
        ("events in the log", f"{log['events_in_log']} in {log['streams']} streams"),
        ("waystation verify", f"exit {figures['verify_exit']}: {figures['verify']}"),
        ("rebuild paused_tasks --check", f"exit {figures['rebuild_paused_tasks_check_exit']}"),
        ("rebuild agent_stats --check", f"exit {figures['rebuild_agent_stats_check_exit']}"),
        ("rebuild agent_minutes --check", f"exit {figures['rebuild_agent_minutes_check_exit']}"),
        (
            "projections",
            f"{figures['paused_tasks_left']} tasks left paused; agent_stats: "
            f"{figures['agent_stats_orchestrator_completed']} orchestrator tasks completed",
        ),
        (
            "dead letters",
            f"{dead['count']}: {_reasons(dead['reasons'])}; {dead['unexplained']} unexplained",
        ),
        (
            "settled",
            "yes: the outbox and every queue empty, nothing unacked"
            if figures["settled"]
            else "NO",
        ),
        (
            "faults injected",
            f"{injected.get('kill', 0)} SIGKILLs, {injected.get('close', 0)} "
            f"close_all_connections, {injected.get('pg-restart', 0)} PostgreSQL restarts",
        ),
        (
            "processes",
            f"{figures['processes_started']} started; exit codes on SIGTERM "
            f"{figures['exit_codes_on_sigterm']}",
        ),
        ("warning/error log lines", figures["log_warning_lines"]),
        ("wall time", f"{elapsed:.1f}s"),
    ]
    print("\nfigures")
    for what, value in rows:
        print(f"  {what:<38} {value}")
    print(f"\nresult: {'FAILED' if failures else 'PASSED'}", flush=True)
