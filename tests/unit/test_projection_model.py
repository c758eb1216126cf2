"""``waystation.projections.model``: the shapes its results take outside the projections."""

from __future__ import annotations

from waystation.projections.model import AgentCounts


def test_agent_counts_show_the_mean_pause_instead_of_the_total() -> None:
    counts = AgentCounts(
        completed=4,
        failed=1,
        cancelled=2,
        paused_now=3,
        timeouts=5,
        pauses_resumed=2,
        pause_microseconds=3_000_000,
    )
    assert counts.to_json() == {
        "completed": 4,
        "failed": 1,
        "cancelled": 2,
        "paused_now": 3,
        "timeouts": 5,
        "pauses_resumed": 2,
        "mean_pause_seconds": 1.5,
    }
    assert AgentCounts().to_json()["mean_pause_seconds"] is None
