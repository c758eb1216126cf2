"""The pieces of ``scripts/chaos`` (not part of the library).

* :mod:`.plan`: what the run will do, pure functions of its seed: which tasks are special and
  what each must get, when each fault lands;
* :mod:`.answers`: every task answered as its kind expects, every dead letter explained;
* :mod:`.hostile`: the hostile publisher's messages, and what became of each;
* :mod:`.collector`: the durable result collector (full queues and the hostile messages'
  answers too), a worker's ``/healthz`` and ``/metrics``.

Worker processes, queues, databases, scratch clusters and the checks of a log are the harness
the scripts share: :mod:`scripts.lab.harness`.
"""
