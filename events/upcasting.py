"""Upcasting: reading events stored under an older schema version as the current shape.

An event's shape is versioned by its class's ``schema_version``; the log keeps the version each
event was written with, and never rewrites it (the hash chain covers the stored data). Old events
are converted on read instead: an *upcaster* is a pure function ``dict -> dict`` registered for
``(event_type, from_version)`` that turns the data of ``from_version`` into the data of
``from_version + 1``. :func:`waystation.events.model.parse` runs the chain from the stored version
up to the class's current one, then validates the result::

    upcasters = Upcasters()

    @upcasters.register("TaskPaused", from_version=1)
    def _name_the_calls(data: dict[str, Any]) -> dict[str, Any]:
        return {**data, "calls": [{**c, "label": None} for c in data["calls"]]}

The chain starts from a deep copy of the stored data, so an upcaster that mutates its argument
still cannot change the recorded event (whose hash must keep verifying).

When the chain cannot be run, :meth:`Upcasters.upcast` raises :class:`UpcastError`, and ``parse``
turns that into an :class:`~waystation.events.model.UnknownEvent` carrying the stored type, version,
data and the reason, rather than crashing the reader or dropping the event:

* ``newer-version``: the stored version is newer than this code knows (a newer writer during a
  rolling upgrade). Upgrade the reader; the event is intact in the log.
* ``missing-upcaster``: a step of the chain is not registered (a bug: bumping a
  ``schema_version`` needs an upcaster from the version before).

``fold`` ignores such an event like any unknown one, and
``waystation.projections.audit.verify_stream`` reports it as ``unsupported-version``, so an audit
never passes over what it could not read.

A version that only adds fields with defaults needs no conversion: :meth:`Upcasters.additive`
registers such a step, and data whose chain is additive alone is read as stored, without a copy.

The upcasters of the built-in event types live in :data:`BUILTIN`. Register them here, next to
the bump of the class's ``schema_version``; nothing else should mutate :data:`BUILTIN`. Code with
event types of its own builds its own registry.

Built-in versions:

* ``TaskPaused`` v2 (issue 31) adds to each wait ``kind``, ``name`` and ``signal_schema``, and to
  the pause ``until`` and ``agent_version``, all with defaults. A pause that uses none of them is
  still stored as v1, which older code reads; one that does is stored as v2, which older code
  reads as an unknown event and so decides nothing on (a rolling upgrade stays safe).
* ``TaskResumed`` v2 (issue 31) adds ``abandoned``, the waits a ``FirstK`` pause gave up, with a
  default. A resume that gives up none is still stored as v1; one that does as v2, for the same
  reason.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, Literal

__all__ = ["BUILTIN", "UpcastError", "Upcaster", "Upcasters"]

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""The data of version ``n`` in, the data of version ``n + 1`` out; no I/O, no clock."""


class UpcastError(Exception):
    """Stored data cannot be brought to the current version of its event type."""

    def __init__(
        self,
        event_type: str,
        stored_version: int,
        current_version: int,
        reason: Literal["newer-version", "missing-upcaster"],
        *,
        missing_from: int | None = None,
    ) -> None:
        self.event_type = event_type
        self.stored_version = stored_version
        self.current_version = current_version
        self.reason: Literal["newer-version", "missing-upcaster"] = reason
        self.missing_from = missing_from
        """For ``missing-upcaster``: the version whose step to the next is not registered."""
        if reason == "newer-version":
            what = f"is newer than this code knows (v{current_version})"
        else:
            what = f"cannot reach v{current_version}: no upcaster from v{missing_from}"
        super().__init__(f"{event_type} schema v{stored_version} {what}")


class Upcasters:
    """A registry of upcasters by ``(event_type, from_version)``."""

    def __init__(self) -> None:
        self._steps: dict[tuple[str, int], Upcaster] = {}

    def register(self, event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        """Decorator: ``upcaster`` turns ``event_type`` data of ``from_version`` into the next."""

        def add(upcaster: Upcaster) -> Upcaster:
            self.add(event_type, from_version, upcaster)
            return upcaster

        return add

    def additive(self, event_type: str, from_version: int) -> None:
        """Version ``from_version + 1`` of ``event_type`` only adds fields with defaults: its
        older data reads as it is."""
        self.add(event_type, from_version, _additive)

    def add(self, event_type: str, from_version: int, upcaster: Upcaster) -> None:
        if from_version < 1:
            raise ValueError(f"schema versions start at 1, not {from_version}")
        key = (event_type, from_version)
        if key in self._steps:
            # two steps for one version would make the result depend on registration order
            raise ValueError(f"an upcaster of {event_type} from v{from_version} is registered")
        self._steps[key] = upcaster

    def steps(self) -> Mapping[tuple[str, int], Upcaster]:
        """What is registered, by ``(event_type, from_version)``."""
        return dict(self._steps)

    def upcast(
        self, event_type: str, data: dict[str, Any], *, stored: int, current: int
    ) -> dict[str, Any]:
        """``data`` of version ``stored`` as version ``current`` (``data`` itself when they are
        equal); :class:`UpcastError` for a newer stored version or a missing step."""
        if stored == current:
            return data
        if stored > current:
            raise UpcastError(event_type, stored, current, "newer-version")
        chain = []
        for version in range(stored, current):
            step = self._steps.get((event_type, version))
            if step is None:
                raise UpcastError(
                    event_type, stored, current, "missing-upcaster", missing_from=version
                )
            chain.append(step)
        if all(step is _additive for step in chain):
            return data
        upcast = copy.deepcopy(data)
        for version, step in enumerate(chain, start=stored):
            upcast = step(upcast)
            if not isinstance(upcast, dict):
                raise TypeError(
                    f"the upcaster of {event_type} from v{version} returned "
                    f"{type(upcast).__name__}, not a dict"
                )
        return upcast


def _additive(data: dict[str, Any]) -> dict[str, Any]:
    return data


BUILTIN = Upcasters()
"""The upcasters of the built-in event types (``waystation.events.model``); ``parse`` uses them by
default."""
BUILTIN.additive("TaskPaused", 1)
BUILTIN.additive("TaskResumed", 1)
