"""A deterministic simulation of the real worker (issue 11 section 3).

Several real :class:`~waystation.runtime.worker.Worker` instances run over the in-memory broker and
an in-memory event store behind a fault layer, on an event loop whose clock is virtual and whose
ready queue is shuffled by a seeded generator. A run is a pure function of its seed: the same seed
gives the same log, byte for byte. ``scripts/simulate`` runs many seeds; a failing seed prints the
command that replays it with a step-by-step trace.
"""
