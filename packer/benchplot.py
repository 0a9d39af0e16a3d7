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


def _series_name(r: dict) -> str:
    return r["name"] if r["workers"] is None else f"{r['name']} ({r['workers']} workers)"


def plot_report(report: dict, path: str) -> None:
    """Write a PNG: for each level a panel of grouped bars (order x cache), a bar per dataset, with
    the relevant ceiling of each bar drawn as a black line across it and the value printed on top."""
    plt = require_matplotlib()
    results = report["results"]
    levels = [lv for lv in ("read", "decode", "loader") if any(r["level"] == lv for r in results)]
    fig, axes = plt.subplots(1, len(levels), figsize=(6.5 * len(levels), 5.2), squeeze=False)
    colours = plt.get_cmap("tab10")
    series_all: list[str] = []
    for r in results:
        if _series_name(r) not in series_all:
            series_all.append(_series_name(r))
    for ax, level in zip(axes[0], levels):
        rows = [r for r in results if r["level"] == level]
        groups: list[tuple[str, str]] = []
        series: list[str] = []
        for r in rows:
            if (r["order"], r["cache"]) not in groups:
                groups.append((r["order"], r["cache"]))
            if _series_name(r) not in series:
                series.append(_series_name(r))
        width = 0.8 / max(len(series), 1)
        ceiling_labelled = False
        for r in rows:
            g = groups.index((r["order"], r["cache"]))
            s = series.index(_series_name(r))
            x = g + (s - (len(series) - 1) / 2) * width
            v = r["samples_per_s"]["median"]
            ax.bar(x, v, width * 0.92, color=colours(series_all.index(_series_name(r)) % 10),
                   yerr=[[v - r["samples_per_s"]["min"]], [r["samples_per_s"]["max"] - v]], capsize=2,
                   label=_series_name(r) if g == 0 else None)
            ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=7, rotation=90)
            c = r["ceiling"]["samples_per_s"]
            ax.hlines(c, x - width / 2, x + width / 2, colors="black", linewidth=1.6,
                      label=None if ceiling_labelled else "ceiling (same run)")
            ceiling_labelled = True
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{o}\n{c}" for o, c in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("samples/s (log scale; higher is better)")
        ax.set_title({"read": "read: bytes only (the IO term)", "decode": "decode: images as training gets them",
                      "loader": "DataLoader (batches, no transform)"}[level], fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.25)
        ax.legend(fontsize=7, loc="lower right")
    m = report["machine"]
    title = f"packer bench - {m['cpu']}, {m['cores_usable']} cores"
    if report.get("emulation"):
        e = report["emulation"]
        title += f" - EMULATED storage: {e['read_iops'] or 'unlimited'} read IOPS, {(e['read_bps'] or 0) / 1e6:.0f} MB/s"
    ceil = report["ceilings"]
    sub = ", ".join([f"seq. read {v['value']:,.0f} MB/s" for v in ceil["sequential_read"].values()]
                    + [f"memcopy {ceil['memory_copy']['value']:,.0f} MB/s"]
                    + [f"decode {k} {v['value']:,.0f} img/s/core" for k, v in ceil["decode"].items()])
    fig.suptitle(title + "\nceilings measured in the same run: " + sub, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)
