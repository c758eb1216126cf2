"""The projections in PostgreSQL: the runner that follows the log, rebuild, status and queries.

One module per job; import the names below from here:

* :mod:`.feed`: reading the log in commit order up to the snapshot horizon (``read_feed``), and
  applying it batch by batch, each with its checkpoint (``catch_up``); the engine they run on;
* :mod:`.tables`: the projections' tables and how a batch of the log changes them
  (``PROJECTIONS``);
* :mod:`.runner`: ``ProjectionRunner``, one active runner per projection across every instance,
  with failover, woken by NOTIFY with a polling fallback;
* :mod:`.rebuild`: replay from position zero into shadow tables, compared with the live ones;
* :mod:`.queries`: each projection's status and lag, the rows of the read models (the
  paused tasks by keyset pages too: ``paused_tasks_page``), and the console overview's
  reads (agent activity, calls outstanding, slots in use).
"""

from .feed import catch_up, create_engine, read_feed
from .queries import (
    COUNT_UP_TO,
    PAGE_ORDERS,
    WHOLE_UP_TO,
    AgentActivity,
    PausedTasksPage,
    ProjectionStatus,
    SlotUse,
    agent_activity,
    agent_stats,
    calls_outstanding,
    paused_tasks,
    paused_tasks_page,
    projection_status,
    slots_in_use,
)
from .rebuild import RebuildReport, TableDifference, rebuild
from .runner import ProjectionRunner
from .tables import (
    PROJECTIONS,
    AgentMinutesProjection,
    AgentStatsProjection,
    PausedTasksProjection,
    Projection,
)

__all__ = [
    "COUNT_UP_TO",
    "PAGE_ORDERS",
    "PROJECTIONS",
    "WHOLE_UP_TO",
    "AgentActivity",
    "AgentMinutesProjection",
    "AgentStatsProjection",
    "PausedTasksPage",
    "PausedTasksProjection",
    "Projection",
    "ProjectionRunner",
    "ProjectionStatus",
    "RebuildReport",
    "SlotUse",
    "TableDifference",
    "agent_activity",
    "agent_stats",
    "calls_outstanding",
    "catch_up",
    "create_engine",
    "paused_tasks",
    "paused_tasks_page",
    "projection_status",
    "read_feed",
    "rebuild",
    "slots_in_use",
]
