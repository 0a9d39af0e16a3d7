"""``packer bench``'s report in words: progress lines, the terminal table, Markdown for reports and the README."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from packer.diagnose.throttle import SLICE_SECONDS

SHORT_PASS_SLICES = 20  # emulated cold passes shorter than this many throttle slices get a note on their precision


def fmt_rate(v: float) -> str:
    """A rate as people read it: no decimals from 10 up, one below."""
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def progress_line(r: dict) -> str:
    """One measurement in one line, as ``packer bench`` prints it while it runs."""
    s, m = r["samples_per_s"], r["mb_per_s"]
    w = "" if r["workers"] is None else f" w={r['workers']}"
    ev = "" if r["eviction"] in (None, "verified") else f"  [eviction {r['eviction']}]"
    return (f"{r['name']:<16} {r['level']:<6} {r['order']:<10} {r['cache']:<4}{w:<5} "
            f"{fmt_rate(s['median']):>8} samples/s ({fmt_rate(s['min'])}-{fmt_rate(s['max'])})  "
            f"{fmt_rate(m['median']):>7} MB/s{ev}")


def _cells(r: dict) -> dict:
    """One result row's figures as text, for the terminal and the Markdown tables."""
    s = r["samples_per_s"]
    return {"workers": "" if r["workers"] is None else str(r["workers"]), "rate": fmt_rate(s["median"]),
            "range": f"({fmt_rate(s['min'])}-{fmt_rate(s['max'])})", "mbs": fmt_rate(r["mb_per_s"]["median"]),
            "speedup": "" if r["speedup_vs_folder"] is None else f"{r['speedup_vs_folder']:.2f}x",
            "eviction": None if r["eviction"] in (None, "verified") else f"eviction {r['eviction']}",
            "steady": _steady(r)}


def _steady(r: dict) -> str:
    """Loader levels: the rate after the first batch (start-up left out) and its fraction of the ceiling."""
    st, frac = r.get("steady_samples_per_s"), r.get("steady_fraction_of_ceiling")
    return "" if st is None or frac is None else f"{fmt_rate(st['median'])} {frac:.0%}"


def ceiling_summary(ceilings: dict, ranges: bool = False) -> str:
    """The ceilings of a run in one line (with each one's lowest-highest repeat when ``ranges``)."""
    def span(x: dict) -> str:
        return f" ({x['low']:,.0f}-{x['high']:,.0f})" if ranges else ""

    return ", ".join([f"cold sequential read {x['value']:,.0f} MB/s{span(x)}"
                      for x in ceilings["sequential_read"].values()]
                     + [f"memory copy {ceilings['memory_copy']['value']:,.0f} MB/s"]
                     + [f"decode {k} {x['value']:,.0f} img/s per core" for k, x in ceilings["decode"].items()])


def _storage_line(path: str, st: dict) -> str:
    rot = {True: "rotational", False: "non-rotational", None: "unknown"}[st["rotational"]]
    return f"  {path}: {st['fstype']} on {st['device'] or st['source']} ({rot}, read-ahead {st['read_ahead_kb']} KB)"


def bench_table(report: dict) -> str:
    """The human table: one line per measurement, grouped by level, with speed-up and fraction of ceiling."""
    mach = report["machine"]
    lines = [f"packer bench: {mach['cpu']}, {mach['cores_usable']} cores, {mach['os']}"]
    lines += [_storage_line(path, st) for path, st in report["storage"].items()]
    if report.get("emulation"):
        e = report["emulation"]
        lines.append(f"  EMULATED storage ({e['description']}): {e['read_iops'] or 'unlimited'} read IOPS, "
                     f"{(e['read_bps'] or 0) / 1e6:.0f} MB/s, kernel block-IO throttle on {', '.join(e['devices'])}")
    lines.append("  ceilings: " + ceiling_summary(report["ceilings"]))
    head = (f"{'dataset':<16} {'level':<6} {'order':<10} {'cache':<5} {'wkr':>3} {'samples/s':>9} {'(min-max)':<15} "
            f"{'MB/s':>7} {'x folder':>8} {'of ceiling':>10} {'steady':>12}  ceiling")
    lines += ["", head, "-" * len(head)]
    prev = None
    for r in report["results"]:
        if prev is not None and (r["level"], r["dataset"]) != prev:
            lines.append("")
        prev = (r["level"], r["dataset"])
        c = _cells(r)
        lines.append(
            f"{r['name'][:16]:<16} {r['level']:<6} {r['order']:<10} {r['cache']:<5} {c['workers']:>3} {c['rate']:>9} "
            f"{c['range']:<15} {c['mbs']:>7} {c['speedup']:>8} {r['fraction_of_ceiling']:>10.0%} {c['steady']:>12}  "
            f"{r['ceiling']['name']}" + (f"  [{c['eviction']}]" if c["eviction"] else ""))
    lines.append("")
    lines.append(f"median of {report['options']['repeats']} repeats (min-max); steady: loader levels after their first "
                 "batch (start-up left out); samples per pass: "
                 + ", ".join(f"{Path(d['path']).name} {d['samples']}" for d in report["datasets"]))
    note = emulation_note(report)
    if note:
        lines.append(f"note: {note}")
    lines.append(f"in short: {takeaway(report)}")
    return "\n".join(lines)


def emulation_note(report: dict) -> str | None:
    """Under emulated storage, when cold passes last few throttle slices: by how much one slice moves their rate
    (1-second passes: 10 %, as much as the difference between meeting a goal and missing it; docs/results.md)."""
    if not report.get("emulation"):
        return None
    secs = [statistics.median(r["seconds"]) for r in report["results"] if r["cache"] == "cold" and r.get("seconds")]
    short = [s for s in secs if s < SHORT_PASS_SLICES * SLICE_SECONDS]
    if not short:
        return None
    lo, hi = min(short), max(short)
    slices = f"the emulated disk's kernel throttle meters reads in {SLICE_SECONDS * 1e3:.0f} ms slices"
    if lo < SLICE_SECONDS:
        return (f"{slices}, and cold passes here last {_seconds(lo)} and more: a pass shorter than a slice says more "
                "about the throttle than about the reader; give each pass more samples")
    span = _seconds(lo) if _seconds(lo) == _seconds(hi) else f"{_seconds(lo)[:-2]}-{_seconds(hi)}"
    return (f"{slices}, and a pass may run up to a slice ahead of its limit or wait up to one behind it: the rate "
            f"of a cold pass of {span} can be off by up to {100 * SLICE_SECONDS / lo:.0f} % either way; more "
            "samples per pass give tighter figures")


def _seconds(x: float) -> str:
    return f"{x:.1f} s" if x >= 0.1 else f"{x * 1e3:.0f} ms"


def print_progress(line: str) -> None:
    """The progress log of ``packer bench``: stderr, so that stdout keeps the table or the JSON."""
    print(line, file=sys.stderr, flush=True)


def markdown_table(report: dict, levels: Sequence[str] | None = None) -> str:
    """The results as a Markdown table (for reports and the README)."""
    out = ["| dataset | level | order | cache | workers | samples/s (min-max) | MB/s | x folder | of ceiling "
           "| steady (of ceiling) | ceiling |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in report["results"]:
        if levels and r["level"] not in levels:
            continue
        c = _cells(r)
        ev = f" ({c['eviction']})" if c["eviction"] else ""
        out.append(f"| {r['name']} | {r['level']} | {r['order']} | {r['cache']}{ev} | {c['workers']} "
                   f"| {c['rate']} {c['range']} | {c['mbs']} | {c['speedup']} | {r['fraction_of_ceiling']:.0%} "
                   f"| {c['steady']} | {r['ceiling']['name']} |")
    return "\n".join(out)


def describe_setup(report: dict) -> str:
    """Machine, storage, emulation and ceilings in a few Markdown bullet lines."""
    m = report["machine"]
    v = m["versions"]
    lines = [f"- machine: {m['cpu']}, {m['cores_usable']} cores usable, {(m['memory_bytes'] or 0) / 2**30:.0f} GiB, "
             f"{m['os']}, load average at start {', '.join(f'{x:.1f}' for x in m['load_average'] or [])}",
             "- software: " + ", ".join(f"{k} {val}" for k, val in v.items() if val)]
    for path, st in report["storage"].items():
        lines.append(f"- `{path}`: {st['fstype']} on {st['device'] or st['source']} ({st['major_minor']}), "
                     f"rotational={st['rotational']}, read-ahead {st['read_ahead_kb']} KB, scheduler {st['scheduler']}")
    if report.get("emulation"):
        e = report["emulation"]
        lines.append(f"- EMULATED storage: {e['read_iops']} read IOPS, {(e['read_bps'] or 0) / 1e6:.0f} MB/s "
                     f"({e['description']}); {e['controller']} on {', '.join(e['devices'])}")
    lines.append("- ceilings (same run): " + ceiling_summary(report["ceilings"], ranges=True))
    d = ", ".join(f"`{Path(x['path']).name}` {x['samples']} samples, {x['payload_bytes'] / 1e6:.0f} MB of payload, "
                  f"{x['files']} files, {x['disk_bytes'] / 1e6:.0f} MB on disk" for x in report["datasets"])
    lines.append(f"- datasets: {d}")
    o = report["options"]
    from packer.read import sampler

    blk = o.get("block_bytes") or sampler.DEFAULT_BLOCK_BYTES
    lines.append(f"- options: repeats {o['repeats']}, batch size {o['batch_size']}, block order (packer.read.sampler): "
                 f"{blk / 1e6:.0f} MB blocks, windows of {o.get('open_blocks') or sampler.DEFAULT_OPEN_BLOCKS} "
                 "open blocks, "
                 f"runs of {o.get('run') or sampler.DEFAULT_RUN}, seed {o['seed']}, pin_memory {o['pin_memory']}")
    return "\n".join(lines)


def _span(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.1f}x" if f"{lo:.1f}" == f"{hi:.1f}" else f"{lo:.1f}-{hi:.1f}x"


def takeaway(report: dict) -> str:
    """One line with what the run shows, computed from its figures: what bounds the loose folder here, and
    how much faster than the folder the packed datasets of encoded images and of stored pixels are."""
    results = report["results"]
    levels = ("loader", "thread", "train", "thread-train", "decode", "read")  # the first one run speaks
    level = next((lv for lv in levels if any(r["level"] == lv for r in results)), None)
    if level is None:
        return "no measurements"
    rows = [r for r in results if r["level"] == level]
    payload = {Path(d["path"]).name: (d["kind"], d["payload"]) for d in report["datasets"]}
    folder = [r for r in results if payload.get(r["name"], ("", ""))[0] == "folder"]
    parts = []
    if folder and level != "read":
        cold = [r["samples_per_s"]["median"] for r in folder if r["level"] == "read" and r["cache"] == "cold"]
        ceiling = [r["ceiling"]["samples_per_s"] for r in folder if r["level"] == level]
        if cold and ceiling:
            bound = "decode-bound" if min(cold) >= max(ceiling) else "IO-bound"
            parts.append(f"{bound} here (the folder reads {fmt_rate(min(cold))}+ samples/s cold, "
                         f"its cores decode {fmt_rate(max(ceiling))}/s)")
    for kind, words in (("encoded", "packed encoded images"), ("raw", "stored pixels")):
        ups = [r["speedup_vs_folder"] for r in rows if r["speedup_vs_folder"] is not None
               and payload.get(r["name"], ("", ""))[1] == kind and payload[r["name"]][0] != "folder"]
        if ups:
            parts.append(f"{words} {_span(ups)} the folder")
    if not parts:  # no folder in the run: how near the packed datasets come to their ceilings
        near = [r for r in rows if r.get("fraction_of_ceiling") is not None]
        if near:
            lo, hi = (f"{100 * f(r['fraction_of_ceiling'] for r in near):.0f}" for f in (min, max))
            names = sorted({r["ceiling"]["name"] for r in near})
            parts.append(f"{lo if lo == hi else f'{lo}-{hi}'} % of the ceiling ({', '.join(names)})")
    return (f"{level} level: " if level != "decode" else "") + "; ".join(parts) if parts else f"{level} level"
