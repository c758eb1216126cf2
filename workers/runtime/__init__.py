"""The worker's pipeline: a delivery in, a decision recorded, its messages out, the delivery
settled.

* :mod:`.worker`: :class:`~.worker.Worker`, which consumes, inspects and dispatches each delivery;
* :mod:`.flows`: one flow per kind of message (a task, a reply, a resume, a cancel, ...), each
  deciding through the pure state machine (``waystation.events.task``);
* :mod:`.recorder`: read a task's stream, decide, append (G4) and hand on what was committed,
  with :mod:`.decisions`, :mod:`.streams` (locks and the copy of streams), :mod:`.combining`
  (decisions recorded together) and :mod:`.outages`;
* :mod:`.compose`: the adapters of a production worker;
* :mod:`.outbox`: publishing what was committed, and the relay that publishes what was not yet;
* :mod:`.verdicts`: what a flow says should become of its delivery; :mod:`.settle`: the one
  place that carries it out, acking, requeueing and dead-lettering (G1);
* :mod:`.sweeper`: deadlines; :mod:`.routing`: reply shards; :mod:`.limits`: the pool's
  concurrency and rate slots as the worker takes them; :mod:`.faults`: crash points for tests.
"""
