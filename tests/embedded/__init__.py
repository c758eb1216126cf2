"""The real worker on the in-memory broker and event store: no services, fast, exact.

These tests steer what the real services would only do by chance (a delivery returned at a
chosen moment, another writer appending between two steps, RabbitMQ 4.3's counting).
"""
