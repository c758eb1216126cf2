"""What ``waystation tasks`` says of the paused-tasks projection, from where it stands."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from waystation.cli.tasks import lag_warning
from waystation.events.store import Position
from waystation.projections.postgres import ProjectionStatus

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)


def standing(
    behind: int, *, ran: bool = True, active: bool = False, lag: float = 0.0
) -> ProjectionStatus:
    return ProjectionStatus(
        name="paused_tasks",
        position=Position(7, 40) if ran else Position(),
        events=40 if ran else 0,
        updated_at=NOW - timedelta(minutes=3) if ran else None,
        behind=behind,
        lag_seconds=lag,
        active=active,
    )


def test_a_projection_up_to_date_has_nothing_to_say_runner_or_not() -> None:
    assert lag_warning(standing(0), NOW) is None
    assert lag_warning(standing(0, active=True), NOW) is None
    assert lag_warning(standing(0, ran=False), NOW) is None, "an empty log: nothing is missing"


def test_a_projection_never_run_says_how_many_events_it_has_not_seen() -> None:
    said = lag_warning(standing(12, ran=False), NOW)
    assert said is not None and said.startswith(
        "the paused-tasks projection has never run: none of the 12 events in the log is applied"
    )
    assert "start `waystation projections run`" in said


def test_a_projection_behind_without_a_runner_says_when_it_last_applied_events() -> None:
    said = lag_warning(standing(5), NOW)
    assert said is not None
    assert said.startswith(
        "the paused-tasks projection is 5 events behind the log (last applied 3.0m ago) and no "
        "runner is active"
    )


def test_an_active_runner_a_moment_behind_is_not_worth_a_warning_but_one_far_behind_is() -> None:
    assert lag_warning(standing(3, active=True, lag=0.4), NOW) is None
    said = lag_warning(standing(900, active=True, lag=75.0), NOW)
    assert said is not None and "900 events behind" in said and "1.2m old" in said
    assert "although a runner is active" in said
