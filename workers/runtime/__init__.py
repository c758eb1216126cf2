"""The worker's pipeline: a delivery in, a decision recorded, its messages out, the delivery
settled.

* :mod:`.worker`: :class:`~.worker.Worker`, which consumes, inspects and dispatches each delivery;
* :mod:`.flows`: one flow per kind of message (a task, a reply, a resume, a cancel, ...), each
  deciding through the pure state machine (``waystation.events.task``);
* :mod:`.recorder`: read a task's stream, decide, append (G4) and hand on what was committed;
* :mod:`.outbox`: publishing what was committed, and the relay that publishes what was not yet;
* :mod:`.settle`: the one place that acks, requeues and dead-letters (G1);
* :mod:`.sweeper`: deadlines; :mod:`.routing`: reply shards; :mod:`.limits`: the pool's
  concurrency and rate slots as the worker takes them; :mod:`.faults`: crash points for tests.
"""
