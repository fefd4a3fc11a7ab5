"""The sweep's plots (matplotlib, headless): throughput against concurrency and TPOT against
context, DCP 1 against DCP k, and KV capacity against DCP size at the same bytes per device."""

from __future__ import annotations

import pathlib
from collections.abc import Iterable


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _lines(ax, stages: Iterable[dict], x: str, y, group: str, label: str) -> None:
    """One line per (server, value of `group`): y(row) against row[x], for stages that completed."""
    series: dict[tuple, list] = {}
    for row in stages:
        if not row.get("error") and y(row) is not None:
            series.setdefault((row["server"], row[group]), []).append((row[x], y(row)))
    for (server, value), points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{server}, {label} {value}")
    ax.set_xscale("log", base=2)
    xs = sorted({row[x] for row in stages})
    ax.set_xticks(xs, [str(v) for v in xs])  # the stages' own values, not powers of the log base
    ax.minorticks_off()
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)


def draw_sweep(stages: list[dict], capacity: dict[int, int], out: pathlib.Path) -> list[pathlib.Path]:
    """Write the PNGs into `out`; returns their paths."""
    plt = _pyplot()
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    _lines(ax, stages, "concurrency", lambda r: r.get("output_throughput"), "input_len", "context")
    ax.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput against concurrency")
    paths.append(out / "throughput_vs_concurrency.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    fig, ax = plt.subplots(figsize=(6, 4))
    _lines(ax, stages, "input_len", lambda r: (r.get("tpot") or {}).get("median_ms"), "concurrency", "concurrency")
    ax.set(xlabel="context (tokens)", ylabel="TPOT p50 (ms)", title="Time per output token against context")
    paths.append(out / "tpot_vs_context.png")
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    if capacity:
        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = sorted(capacity)
        ax.bar([str(d) for d in sizes], [capacity[d] for d in sizes], color="tab:blue")
        ax.set(xlabel="DCP size (same TP, same KV bytes per device)", ylabel="KV cache size (tokens)",
               title="KV capacity against DCP size")
        paths.append(out / "kv_capacity_vs_dcp.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    plt.close("all")
    return paths
