"""The pieces of ``scripts/chaos`` (not part of the library).

The run's phases, in the order scripts/chaos.py runs them:

* :mod:`.setup`: :class:`~.setup.Chaos`: the run's vhost, scratch PostgreSQL cluster, database,
  queue policy and broker size limit, its worker processes and projection runner, and the
  cleanup whatever happens;
* :mod:`.drive`: the tasks planned and submitted (beside the window through full queues), the
  progress, and settling once every result of the window is in;
* :mod:`.faults`: the SIGKILLs, connection closes and PostgreSQL restarts as planned, and the
  hostile publisher;
* :mod:`.sample`: what is sampled meanwhile (the outbox's oldest row, the workers' counters,
  the broker's size limit);
* :mod:`.check`: every answer, every dead letter and the event log checked, the failures named;
* :mod:`.report`: the figures printed.

And what they use:

* :mod:`.plan`: what the run will do, pure functions of its seed: which tasks are special and
  what each must get, when each fault lands;
* :mod:`.answers`: every task answered as its kind expects, every dead letter explained;
* :mod:`.hostile`: the hostile publisher's messages, and what became of each;
* :mod:`.collector`: the durable result collector (full queues and the hostile messages'
  answers too), a worker's ``/healthz`` and ``/metrics``.

Worker processes, queues, databases, scratch clusters and the checks of a log are the harness
the scripts share: :mod:`scripts.lab.harness`.
"""

K = 3
ROUNDS = 2
PREFIX = "chaos."
HEALTHY_WITHIN = 90.0
"""How long the workers may take to be healthy again before a fault (a restart, a reconnect)."""
SAMPLE_EVERY = 2.0
"""Seconds between two samples of the outbox's oldest row and of the workers' counters."""
FULL_QUEUES = f"{PREFIX}full-"
NEVER_DRAINED = f"{PREFIX}full-never"
HOSTILE_ANSWERS = f"{PREFIX}hostile-answers"
