"""The projections in PostgreSQL: the runner that follows the log, rebuild, status and queries.

One module per job; import the names below from here:

* :mod:`.feed`: reading the log in commit order up to the snapshot horizon (``read_feed``), and
  applying it batch by batch, each with its checkpoint (``catch_up``); the engine they run on;
* :mod:`.tables`: the projections' tables and how a batch of the log changes them
  (``PROJECTIONS``);
* :mod:`.runner`: ``ProjectionRunner``, one active runner per projection across every instance,
  with failover, woken by NOTIFY with a polling fallback;
* :mod:`.rebuild`: replay from position zero into shadow tables, compared with the live ones;
* :mod:`.queries`: each projection's status and lag, and the rows of the read models.
"""

from .feed import catch_up, create_engine, read_feed
from .queries import ProjectionStatus, agent_stats, paused_tasks, projection_status
from .rebuild import RebuildReport, TableDifference, rebuild
from .runner import ProjectionRunner
from .tables import PROJECTIONS, AgentStatsProjection, PausedTasksProjection, Projection

__all__ = [
    "PROJECTIONS",
    "AgentStatsProjection",
    "PausedTasksProjection",
    "Projection",
    "ProjectionRunner",
    "ProjectionStatus",
    "RebuildReport",
    "TableDifference",
    "agent_stats",
    "catch_up",
    "create_engine",
    "paused_tasks",
    "projection_status",
    "read_feed",
    "rebuild",
]
