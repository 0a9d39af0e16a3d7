"""The ``packer bench --plot`` chart: samples/s per dataset, one panel per level, ceilings as lines.

matplotlib is optional (``pip install 'packer[plot]'``); without it the command says so and stops
before measuring anything.
"""

from __future__ import annotations

from packer.errors import PackerError


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PackerError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'packer[plot]'); or drop --plot"
        ) from None
    return plt


def plot_report(report: dict, path: str) -> None:
    """Write a PNG: for each level a panel of grouped bars (order x cache), one colour per dataset (hatched
    per DataLoader worker count), each bar's ceiling drawn as a black line across it, values printed on top."""
    import math

    from matplotlib.patches import Patch

    plt = require_matplotlib()
    results = report["results"]
    levels = [lv for lv in ("read", "decode", "loader") if any(r["level"] == lv for r in results)]
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
                      "loader": "DataLoader: batches, no transform"}[level], fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.25)
    handles = [Patch(color=colours(i % 10), label=n) for i, n in enumerate(names)]
    handles += [Patch(facecolor="white", edgecolor="0.3", hatch=hatches[i % len(hatches)], label=f"{w} workers")
                for i, w in enumerate(workers)] if len(workers) > 1 else []
    handles.append(plt.Line2D([], [], color="black", linewidth=1.8, label="its ceiling, measured in the same run"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    m = report["machine"]
    title = f"packer bench - {m['cpu']}, {m['cores_usable']} cores"
    if report.get("emulation"):
        e = report["emulation"]
        title += f" - EMULATED storage: {e['read_iops'] or 'unlimited'} read IOPS, {(e['read_bps'] or 0) / 1e6:.0f} MB/s"
    ceil = report["ceilings"]
    sub = ", ".join([f"cold sequential read {v['value']:,.0f} MB/s" for v in ceil["sequential_read"].values()]
                    + [f"memory copy {ceil['memory_copy']['value']:,.0f} MB/s"]
                    + [f"decode {k} {v['value']:,.0f} img/s/core" for k, v in ceil["decode"].items()])
    fig.suptitle(title + "\nceilings: " + sub, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
