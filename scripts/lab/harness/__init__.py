"""The harness that the tests and the scripts (bench, demo, chaos) share.

Real services, real processes, no pytest: a script imports these modules as well as a test.

* :mod:`.processes`: worker subprocesses (:class:`~.processes.WorkerProcess`), the
  ``waystation`` command, free ports, process logs and the counters a stopping worker writes.
* :mod:`.broker`: the queues of a deployment (consumers, depths, deletion) and ``rabbitmqctl``
  (connections, unsettled messages, vhosts, the delivery-limit policy, the global counters).
* :mod:`.database`: database URLs, scratch PostgreSQL clusters, and what is paused right now.
* :mod:`.clients`: publishers that keep every result message they receive.
* :mod:`.checks`: what must hold of a run's results and of its event log.
* :mod:`.console`: the console's scene (workers, projections, a console and the tasks a person
  finds there) and Debian's Chromium, for the browser tests and ``scripts/console-screenshots``.
* :mod:`.guarded`: a script's run whose cleanup happens whatever stops it
  (:func:`~.guarded.run_guarded`).

What only tests need (``require``, fixtures support, test-played peers) is in ``tests/support``;
what only the benchmark measures (CPU, memory, database counters) in ``scripts/_bench``.
"""
