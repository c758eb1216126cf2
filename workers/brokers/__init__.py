"""Backends of the broker port (``waystation.brokers.port``): ``amqp`` (aio-pika, production) and
``memory`` (in memory: tests, the simulation, and trying handlers without services)."""
