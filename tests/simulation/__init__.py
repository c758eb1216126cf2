"""The deterministic simulation's tests: its engine is in ``scripts/lab/simulation``."""
