"""Integrations with other frameworks, each an optional extra: ``penguiflow`` (PenguiFlow's
StateStore on the event log; ``pip install waystation[penguiflow]``)."""
