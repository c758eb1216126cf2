"""The frame fuzzer: hostile content headers against the real RabbitMQ and a real worker.

Shared by ``tests/integration/test_frame_fuzz.py`` (a bounded, reproducible run in the default
test run) and ``scripts/fuzz`` (long runs); no pytest in it.

* :mod:`.amqp`: the bytes of AMQP 0-9-1 values written by hand (short strings that are not
  UTF-8, tables nested thousands deep, lengths that lie, type tags nobody knows), a raw client
  over asyncio streams that publishes them, and a lenient reader of what comes back.
* :mod:`.messages`: one hostile message (its content header, its body carrying a fuzz id, and
  what each part is, in words), the hypothesis strategies that draw them, and the known
  triggers as fixed cases.
* :mod:`.campaign`: a worker process of ``tests/apps/fuzz_target.py`` as the target, and the
  checks after each message: its fate (the handler ran, or a dead letter with a reason, or the
  broker refused it), the worker still on the same broker connection and answering a normal
  task, nothing left unsettled.
"""
