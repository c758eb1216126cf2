"""The broker port on RabbitMQ (aio-pika over aiormq): production's adapter.

* :mod:`.broker`: :class:`~.broker.AmqpBroker`, the port's implementation;
* :mod:`.topology`: the exchanges, queues and policies a deployment declares;
* :mod:`.frames`: the frame dispatcher that guards the content headers of Waystation's own
  connections (and the faster codec behind ``WAYSTATION_FAST_FRAMES``);
* :mod:`.transport`: the guarded reader of the client's and the command line's connections;
* :mod:`.deadletters`: inspecting and replaying the dead-letter queue.
"""
