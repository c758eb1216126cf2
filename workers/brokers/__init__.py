"""Backends of the broker port (``waystation.broker``): ``amqp`` (aio-pika, production) and
``memory`` (in memory: tests, the simulation, and trying handlers without services)."""
