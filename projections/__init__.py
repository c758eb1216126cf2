"""Read models derived from the event log, and its audit. Depends on ``events`` only.

* :mod:`waystation.projections.model`: the projections as pure functions (a batch of the log in, row
  changes out): paused tasks and per-agent statistics.
* :mod:`waystation.projections.postgres`: the runner that keeps them up to date (snapshot-horizon
  cursor, set-based batches with their checkpoint in one transaction, one active runner per
  projection with failover, NOTIFY with a polling fallback), rebuild into shadow tables, status
  and lag.
* :mod:`waystation.projections.audit`: verify a stream (hash chain and invariants), and read the
  streams to audit.
* :mod:`waystation.projections.history`: a stream's timeline, and a task's state as of a past
  position or time.
* :mod:`waystation.projections.export`: export to JSONL with redaction.
* :mod:`waystation.projections.exported`: reading an export back, and its offline verification.
"""

__all__: list[str] = []
