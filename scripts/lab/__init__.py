"""The lab: what the scripts and the tests share, and no pytest in it.

* :mod:`.harness`: real services and real processes (worker subprocesses, queues, databases,
  publishers that keep their results, the checks of a run's results and its log);
* :mod:`.simulation`: the deterministic simulation of the real worker (``scripts/simulate``,
  ``tests/simulation``);
* :mod:`.fuzz`: the frame fuzzer (``scripts/fuzz``, ``tests/integration/test_frame_fuzz.py``).

The scripts import it as ``scripts.lab`` (each puts the repository's root on ``sys.path``), the
tests as well; nothing here imports from ``tests/``.
"""
