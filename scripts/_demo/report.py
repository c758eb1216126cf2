"""The demo's report: the rows of the summary of what held, printed at the end."""

from __future__ import annotations

from . import PROJECTION, TASKS
from .check import Checked
from .drive import Driven
from .output import Line
from .setup import Demo


def summary_lines(demo: Demo, driven: Driven, checked: Checked) -> list[Line]:
    """The rows of the summary, each a check that held or not."""
    task_ids, results, wrong = driven.task_ids, driven.results, checked.wrong
    replacement = demo.workers[-1]
    moved_by = f"{demo.killed.name} -> {replacement.name}" if demo.killed else "none"
    return [
        Line("tasks submitted", str(len(task_ids)), len(task_ids) == TASKS),
        Line(
            "completed correctly",
            str(len(results) - len(wrong)),
            not wrong and len(results) == TASKS,
        ),
        Line("lost", str(checked.lost), checked.lost == 0),
        Line("duplicated", str(checked.duplicated), checked.duplicated == 0),
        Line("waystation verify", checked.verified[1], checked.verified[0]),
        Line(PROJECTION, checked.projection[1], checked.projection[0]),
        Line(
            "killed -> replaced",
            f"{moved_by}, {checked.taken_over} of its paused tasks moved",
            demo.killed is not None,
        ),
        Line(
            "exit 0 on SIGTERM",
            f"{sum(c == 0 for c in checked.codes.values())} of {len(checked.codes)} processes",
            checked.stopped_ok,
        ),
    ]
