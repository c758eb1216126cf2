"""Read models derived from the event log (paused tasks, per-agent statistics), and its audit.

Built so far: :mod:`projections.audit` (verify a stream, read it as a timeline). Not built yet:
the projection runner, the projections, rebuild, export and point-in-time state (issue 4). This
package depends on ``events`` only.
"""

__all__: list[str] = []
