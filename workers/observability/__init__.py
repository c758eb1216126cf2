"""What a worker tells about itself: the observer the pipeline reports to, and its metrics.

* :mod:`.observer`: :class:`~.observer.Observer`, the counters and timings the pipeline records;
* :mod:`.metrics`: those as Prometheus metrics, served on ``WAYSTATION_METRICS_PORT``.
"""
