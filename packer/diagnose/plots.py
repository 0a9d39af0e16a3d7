"""The charts of ``packer bench --plot`` (samples/s per dataset against the ceilings) and ``packer profile --plot``.

matplotlib is optional (``pip install -e '.[plot]'`` in packer's checkout); without it the commands say so and stop
before measuring anything (``require_matplotlib``).
"""

from __future__ import annotations

import math
import os
import textwrap
from typing import TYPE_CHECKING

from packer.diagnose.reports import ceiling_summary, fmt_rate, takeaway
from packer.errors import MissingPackageError, install_hint

if TYPE_CHECKING:
    from packer.diagnose.sweep import SweepPoint, SweepResult


def require_matplotlib():
    """matplotlib's pyplot on the Agg backend, or a PackerError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingPackageError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            f"(or {install_hint('plot')}); or drop --plot"
        ) from None
    return plt


def _ceiling_segments(bars: list[tuple[float, float]], width: float) -> list[tuple[float, float, float]]:
    """(x0, x1, ceiling) lines: neighbouring bars that share a ceiling get one line across them."""
    out: list[tuple[float, float, float]] = []
    for x, ceiling in bars:
        if out and math.isclose(out[-1][2], ceiling, rel_tol=1e-9) and math.isclose(out[-1][1], x - width / 2):
            out[-1] = (out[-1][0], x + width / 2, ceiling)
        else:
            out.append((x - width / 2, x + width / 2, ceiling))
    return out


def _bench_panel(ax, rows: list[dict], names: list[str], workers: list, colours, hatches: list[str]) -> None:
    """One level's grouped bars: value and "x folder" factor on each (vertical, so they never overlap), the
    min-max range only where there were several repeats, and one ceiling line per run of bars sharing it."""
    groups = list(dict.fromkeys((r["order"], r["cache"]) for r in rows))
    series = list(dict.fromkeys((r["name"], r["workers"]) for r in rows))
    width = 0.82 / max(len(series), 1)
    bars: dict[int, list[tuple[float, float]]] = {}
    labels: list[tuple[float, str]] = []
    for r in rows:
        g = groups.index((r["order"], r["cache"]))
        x = g + (series.index((r["name"], r["workers"])) - (len(series) - 1) / 2) * width
        s = r["samples_per_s"]
        v = s["median"]
        spread = s["max"] > s["min"]
        ax.bar(x, v, width * 0.92, color=colours(names.index(r["name"]) % 10), edgecolor="white",
               hatch=hatches[workers.index(r["workers"]) % len(hatches)] if r["workers"] is not None else "",
               yerr=[[v - s["min"]], [s["max"] - v]] if spread else None, capsize=2, ecolor="0.3")
        factor = r["speedup_vs_folder"]
        label = fmt_rate(v) + ("" if factor is None or r["kind"] == "folder" else f"  {factor:.1f}x")
        labels.append((x, label))
        bars.setdefault(g, []).append((x, r["ceiling"]["samples_per_s"]))
    for group in bars.values():
        for x0, x1, ceiling in _ceiling_segments(group, width):
            ax.hlines(ceiling, x0, x1, colors="black", linewidth=1.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{o}\n{c} cache" for o, c in groups], fontsize=8)
    ax.set_yscale("log")
    low = min(min(r["samples_per_s"]["min"] for r in rows), min(r["ceiling"]["samples_per_s"] for r in rows))
    high = max(max(r["samples_per_s"]["max"] for r in rows), max(r["ceiling"]["samples_per_s"] for r in rows))
    bottom = 10 ** math.floor(math.log10(max(low, 1e-3) * 0.5))  # room for the labels in the shortest bar
    ax.set_ylim(bottom, high * 2)
    for x, label in labels:  # inside the bars, from their foot: clear of the ceiling lines and of each other
        ax.text(x, bottom * 1.15, label, ha="center", va="bottom", rotation=90, fontsize=6.5,
                bbox={"facecolor": "white", "alpha": 0.7, "pad": 0.6, "linewidth": 0})
    ax.set_ylabel("samples/s (log scale, higher is better)")
    ax.grid(axis="y", which="both", alpha=0.25)


LEVEL_TITLES = {"read": "read: stored bytes only (the IO term)", "decode": "decode: images as training gets them",
                "loader": "DataLoader: batches, no transform",
                "thread": "packer.ThreadLoader (folder: DataLoader): batches, no transform",
                "train": "train: DataLoader batches of RandomResizedCrop(224) + flip",
                "thread-train": "thread-train: the same through packer.ThreadLoader (folder: DataLoader)"}


def plot_bench(report: dict, path: str | os.PathLike) -> None:
    """Write a PNG: for each level a panel of grouped bars (order x cache), one colour per dataset (hatched
    per DataLoader worker count), the ceilings as black lines, and the run's takeaway as the caption."""
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt = require_matplotlib()
    results = [{**r, "kind": _kind(report, r["name"])} for r in report["results"]]
    levels = [lv for lv in LEVEL_TITLES if any(r["level"] == lv for r in results)]
    names = list(dict.fromkeys(r["name"] for r in results))
    workers = sorted({r["workers"] for r in results if r["workers"] is not None})
    hatches = ["", "//", "..", "xx", "\\\\", "++"]
    colours = plt.get_cmap("tab10")
    most_bars = max(sum(r["level"] == lv for r in results) for lv in levels)
    # one panel per row, each bar at least 0.16 in wide, so the labels inside the bars never overlap
    fig, axes = plt.subplots(len(levels), 1, figsize=(max(8.0, 0.16 * most_bars + 1.6), 3.9 * len(levels) + 1.3),
                             squeeze=False)
    for ax, level in zip(axes[:, 0], levels, strict=False):
        _bench_panel(ax, [r for r in results if r["level"] == level], names, workers, colours, hatches)
        ax.set_title(LEVEL_TITLES[level], fontsize=10)
    handles: list[Artist] = [Patch(color=colours(i % 10), label=n) for i, n in enumerate(names)]
    handles += [Patch(facecolor="white", edgecolor="0.3", hatch=hatches[i % len(hatches)], label=f"{w} workers")
                for i, w in enumerate(workers)] if len(workers) > 1 else []
    handles.append(Line2D([], [], color="black", linewidth=1.8, label="ceiling, measured in the same run"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), int(fig.get_figwidth() / 1.9)),
               fontsize=8, frameon=False)
    m = report["machine"]
    title = f"packer bench - {m['cpu']}, {m['cores_usable']} cores"
    if report.get("emulation"):
        e = report["emulation"]
        title += (f" - EMULATED storage: {e['read_iops'] or 'unlimited'} read IOPS, "
                  f"{(e['read_bps'] or 0) / 1e6:.0f} MB/s")
    caption = textwrap.fill(takeaway(report), width=int(fig.get_figwidth() * 13))  # ~13 characters an inch at 10 pt
    fig.suptitle(f"{title}\n{caption}", fontsize=10)
    footer = textwrap.fill("bars: samples/s and how many times the folder's rate; ceilings: "
                           + ceiling_summary(report["ceilings"]), width=int(fig.get_figwidth() * 16))
    legend_rows = math.ceil(len(handles) / int(fig.get_figwidth() / 1.9))
    fig.text(0.5, (0.2 + 0.2 * legend_rows) / fig.get_figheight(), footer, ha="center", va="bottom", fontsize=7,
             color="0.35")
    fig.tight_layout(rect=(0, (0.45 + 0.2 * legend_rows + 0.12 * footer.count("\n")) / fig.get_figheight(), 1,
                           1 - (0.25 + 0.17 * caption.count("\n")) / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kind(report: dict, name: str) -> str:
    """The kind of a result's dataset (folder, lmdb, ...) from the report's dataset list."""
    return next((d["kind"] for d in report["datasets"] if os.path.basename(d["path"]) == name), "")


def plot_sweep(result: SweepResult, path: str | os.PathLike) -> None:
    """PNG: wait as % of step (and samples/s) against num_workers, one line per batch size / pin setting."""
    from matplotlib.ticker import MaxNLocator

    from packer.diagnose.profile import FED

    plt = require_matplotlib()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups: dict[tuple[int, bool], list[SweepPoint]] = {}
    for p in result.points:
        groups.setdefault((p.batch_size, p.pin_memory), []).append(p)
    for (b, pin), pts in groups.items():
        pts.sort(key=lambda p: p.workers)
        label = f"batch {b}" + (", pinned" if pin else "")
        ax1.plot([p.workers for p in pts], [100 * p.wait_over_step for p in pts], "o-", label=label)
        ax2.plot([p.workers for p in pts], [p.samples_per_s for p in pts], "o-", label=label)
    ax1.axhline(100 * FED, color="red", ls="--", lw=1, label=f"fed: wait < {100 * FED:.0f}% of step")
    if result.chosen is not None:
        ax1.plot([result.chosen.workers], [100 * result.chosen.wait_over_step], "*", ms=16, color="green",
                 label=f"chosen: num_workers={result.chosen.workers}")
    ax1.set_yscale("symlog", linthresh=10)
    ax1.set_ylim(bottom=0)
    if result.chosen is None:
        ax1.text(0.5, 0.92, "no setting keeps the step fed", transform=ax1.transAxes, ha="center", color="red")
    base = result.points[0].batch_size if result.points else 0
    if result.step_ms > 0 and base:
        ax2.axhline(1000 * base / result.step_ms, color="red", ls="--", lw=1,
                    label=f"asked by the step (batch {base})")
    ax1.set_xlabel("num_workers")
    ax1.set_ylabel("data wait, % of step time")
    ax1.set_title(f"Does the loader feed a {result.step_ms:g} ms step?")
    ax1.legend(fontsize=8)
    ax2.axvline(result.cores, color="grey", ls=":", lw=1, label=f"{result.cores} cores")
    ax2.set_xlabel("num_workers")
    ax2.set_ylabel("samples/s")
    ax2.set_title("Loader throughput with the step running")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"packer profile {result.dataset}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
