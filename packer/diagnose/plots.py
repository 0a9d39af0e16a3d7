"""The charts of ``packer bench --plot`` (samples/s per dataset against the ceilings) and ``packer profile --plot``.

matplotlib is optional (``pip install 'packer-images[plot]'``); without it the commands say so and stop
before measuring anything (``require_matplotlib``).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

from packer._version import DISTRIBUTION
from packer.diagnose.reports import ceiling_summary
from packer.errors import PackerError

if TYPE_CHECKING:
    from packer.diagnose.sweep import SweepPoint, SweepResult


def require_matplotlib():
    """matplotlib's pyplot on the Agg backend, or a PackerError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PackerError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            f"(or pip install '{DISTRIBUTION}[plot]'); or drop --plot"
        ) from None
    return plt


def plot_bench(report: dict, path: str | os.PathLike) -> None:
    """Write a PNG: for each level a panel of grouped bars (order x cache), one colour per dataset (hatched
    per DataLoader worker count), each bar's ceiling drawn as a black line across it, values printed on top."""
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    plt = require_matplotlib()
    results = report["results"]
    levels = [lv for lv in ("read", "decode", "loader", "train") if any(r["level"] == lv for r in results)]
    names = list(dict.fromkeys(r["name"] for r in results))
    workers = sorted({r["workers"] for r in results if r["workers"] is not None})
    hatches = ["", "//", "..", "xx", "\\\\", "++"]
    colours = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, len(levels), figsize=(6.2 * len(levels), 5.4), squeeze=False)
    for ax, level in zip(axes[0], levels, strict=False):
        rows = [r for r in results if r["level"] == level]
        groups = list(dict.fromkeys((r["order"], r["cache"]) for r in rows))
        series = list(dict.fromkeys((r["name"], r["workers"]) for r in rows))
        width = 0.82 / max(len(series), 1)
        low = min(min(r["samples_per_s"]["min"] for r in rows), min(r["ceiling"]["samples_per_s"] for r in rows))
        for r in rows:
            g = groups.index((r["order"], r["cache"]))
            k = series.index((r["name"], r["workers"]))
            x = g + (k - (len(series) - 1) / 2) * width
            v = r["samples_per_s"]["median"]
            ax.bar(x, v, width * 0.92, color=colours(names.index(r["name"]) % 10), edgecolor="white",
                   hatch=hatches[workers.index(r["workers"]) % len(hatches)] if r["workers"] is not None else "",
                   yerr=[[v - r["samples_per_s"]["min"]], [r["samples_per_s"]["max"] - v]], capsize=2, ecolor="0.3")
            ax.text(x, r["samples_per_s"]["max"] * 1.04, f"{v:,.0f}", ha="center", va="bottom", fontsize=6.5)
            ax.hlines(r["ceiling"]["samples_per_s"], x - width / 2, x + width / 2, colors="black", linewidth=1.8)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{o}\n{c} cache" for o, c in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(bottom=10 ** math.floor(math.log10(max(low, 1e-3) * 0.8)))
        ax.set_ylabel("samples/s (log scale, higher is better)")
        ax.set_title({"read": "read: stored bytes only (the IO term)", "decode": "decode: images as training gets them",
                      "loader": "DataLoader: batches, no transform",
                      "train": "DataLoader: RandomResizedCrop(224) batches"}[level], fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.25)
    handles: list[Artist] = [Patch(color=colours(i % 10), label=n) for i, n in enumerate(names)]
    handles += [Patch(facecolor="white", edgecolor="0.3", hatch=hatches[i % len(hatches)], label=f"{w} workers")
                for i, w in enumerate(workers)] if len(workers) > 1 else []
    handles.append(Line2D([], [], color="black", linewidth=1.8, label="its ceiling, measured in the same run"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    m = report["machine"]
    title = f"packer bench - {m['cpu']}, {m['cores_usable']} cores"
    if report.get("emulation"):
        e = report["emulation"]
        title += (f" - EMULATED storage: {e['read_iops'] or 'unlimited'} read IOPS, "
                  f"{(e['read_bps'] or 0) / 1e6:.0f} MB/s")
    fig.suptitle(title + "\nceilings: " + ceiling_summary(report["ceilings"]), fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
