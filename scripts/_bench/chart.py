"""The concurrency chart: throughput and latency against parents in flight, as a PNG.

Two panels over a logarithmic x axis (parents in flight): parents/s, and submit-to-result
latency p50 (solid) and p99 (dashed) on a logarithmic y axis; one line per system (Waystation,
and Celery with ``--compare celery``). matplotlib with the Agg backend (no display needed),
from the ``bench`` extra.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_curve"]

COLOURS = {"waystation": "tab:blue", "celery": "tab:orange"}
LABELS = {"waystation": "Waystation", "celery": "Celery (Redis results)"}


def plot_curve(
    curves: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, *, title: str
) -> Path:
    """Draw ``curves`` (system -> points with ``in_flight``, ``parents_per_s``,
    ``latency_p50_ms``, ``latency_p99_ms``) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    figure, (rate, latency) = plt.subplots(1, 2, figsize=(11, 4.5), constrained_layout=True)
    for system, points in curves.items():
        if not points:
            continue
        x = [p["in_flight"] for p in points]
        colour = COLOURS.get(system)
        label = LABELS.get(system, system)
        rate.plot(x, [p["parents_per_s"] for p in points], "o-", color=colour, label=label)
        latency.plot(
            x, [p["latency_p50_ms"] for p in points], "o-", color=colour, label=f"{label} p50"
        )
        latency.plot(
            x, [p["latency_p99_ms"] for p in points], "s--", color=colour, label=f"{label} p99"
        )
    every_x = sorted({p["in_flight"] for points in curves.values() for p in points})
    for axes in (rate, latency):
        axes.set_xscale("log")
        axes.set_xticks(every_x)
        axes.xaxis.set_major_formatter(ScalarFormatter())
        axes.set_xlabel("parents in flight")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize="small")
    rate.set_ylabel("parents/s")
    rate.set_ylim(bottom=0)
    rate.set_title("throughput")
    latency.set_yscale("log")
    latency.set_ylabel("submit-to-result latency, ms")
    latency.set_title("latency")
    figure.suptitle(title, fontsize="medium")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
