"""The phases of scripts/demo (not part of the library), in the order scripts/demo.py runs them.

* :mod:`.setup`: :class:`~.setup.Demo`: its database, queues, worker processes and projection
  runner, one demo at a time per PostgreSQL server, and the cleanup whatever happens;
* :mod:`.drive`: the submissions, one worker SIGKILLed in the middle of a burst and replaced,
  and the live progress;
* :mod:`.check`: the results, the event log, ``waystation verify``, the projection, the exit
  codes on SIGTERM, and what the logs say of the recovery;
* :mod:`.report`: the rows of the summary;
* :mod:`.output`: what is printed, plain text: the progress, the checks, the summary;
* :mod:`.embedded`: the same story without services (``--embedded``, or when they cannot be
  reached), in one process on the public test kit, ``waystation.testing.InMemoryPool``.

Worker processes, queues, databases and the checks of a log are the harness the scripts share:
:mod:`scripts.lab.harness`.
"""

from __future__ import annotations

from waystation.example import app as example_app

TASKS = 500
K = 3
WORK_MS = 30
WORKERS = 3
DATABASE = "waystation_demo"
PREFIX = "demo."
AGENTS = tuple(example_app.agents)
PROJECTION = "paused_tasks"
