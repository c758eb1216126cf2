"""Crash injection for tests: a worker kills itself with SIGKILL at a named step.

Steps (``WAYSTATION_FAULT_POINT``):

* ``pause.committed``    a task's pause committed, its peer requests not yet published
* ``pause.published``    the peer requests are published, the task message not yet acked
* ``reply.committed``    a reply's claim (and resume, and a run resumed in place) committed,
  nothing published or acked
* ``reply.published``    its messages (the resume message, or the in-place run's result or peer
  requests) are published, the reply not yet acked
* ``resume.in-place``    the last reply's handler run in place returned, nothing of it recorded
* ``resume.committed``   a resume message's run: its next pause or completion committed, nothing
  published
* ``resume.published``   its messages are published, the resume message not yet acked

SIGKILL is the point: no ``finally`` runs, no buffer is flushed, exactly like a power cut.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FaultPlan"]


class FaultPlan:
    def __init__(self, point: str | None = None, after: int = 1) -> None:
        self.point = point
        self.after = after
        self._hits = 0

    def hit(self, step: str) -> None:
        if step != self.point:
            return
        self._hits += 1
        if self._hits >= self.after:
            os.kill(os.getpid(), signal.SIGKILL)
