"""What a worker tells about itself: counters and metrics, logs, and spans.

* :mod:`.observer`: :class:`~.observer.Observer`, the counters and timings the pipeline records;
* :mod:`.metrics`: those as Prometheus metrics, served on ``WAYSTATION_METRICS_PORT``;
* :mod:`.logs`: log lines as text or JSON, each with the task, sub-task and trace it is about;
* :mod:`.tracing`: OpenTelemetry spans of every task (the ``otel`` extra), and the W3C trace ids
  the logs and the messages carry with or without it.
"""
