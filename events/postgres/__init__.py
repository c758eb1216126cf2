"""The event log on PostgreSQL: SQLAlchemy 2 Core over asyncpg.

One module per job; import the names below from here:

* :mod:`.store`: ``PostgresEventStore``, its engine (``create_engine``) and how its connections
  are shared between the hot path and the rest (``split_pool``);
* :mod:`.statements`: the SQL the store runs;
* :mod:`.horizon`: the snapshot horizon that readers of the log in commit order stop below
  (``SNAPSHOT_HORIZON``, shared with the projections' feed), and what holds it
  (``horizon_holder``);
* :mod:`.translate`: driver and SQLAlchemy errors as the log's own (``translate_error``).
"""

from .horizon import SNAPSHOT_HORIZON, HorizonHolder, horizon_holder
from .store import PostgresEventStore, create_engine, split_pool
from .translate import translate_error

__all__ = [
    "SNAPSHOT_HORIZON",
    "HorizonHolder",
    "PostgresEventStore",
    "create_engine",
    "horizon_holder",
    "split_pool",
    "translate_error",
]
