"""``packer bench``'s report in words: progress lines, the terminal table, Markdown for reports and the README."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from packer.diagnose.throttle import SLICE_SECONDS

SHORT_PASS_SLICES = 20  # emulated cold passes shorter than this many throttle slices get a note on their precision
LEVEL_WIDTH = len("thread-train")  # the longest of bench.BENCH_LEVELS: every level's column lines up
BUSY_WAIT = 0.25  # in-process passes that waited this share of their time for a CPU ran on a busy machine
CPU_LIMITED = 0.5  # a cold read pass on a CPU or waiting for one this share of its time was not held up by the disk


def fmt_rate(v: float) -> str:
    """A rate as people read it: no decimals from 10 up, one below."""
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def progress_line(r: dict) -> str:
    """One measurement in one line, as ``packer bench`` prints it while it runs."""
    s, m = r["samples_per_s"], r["mb_per_s"]
    w = "" if r["workers"] is None else f" w={r['workers']}"
    ev = "" if r["eviction"] in (None, "verified") else f"  [eviction {r['eviction']}]"
    return (f"{r['name']:<16} {r['level']:<{LEVEL_WIDTH}} {r['order']:<10} {r['cache']:<4}{w:<5} "
            f"{fmt_rate(s['median']):>8} samples/s ({fmt_rate(s['min'])}-{fmt_rate(s['max'])})  "
            f"{fmt_rate(m['median']):>7} MB/s{ev}")


def _cells(r: dict) -> dict:
    """One result row's figures as text, for the terminal and the Markdown tables."""
    s = r["samples_per_s"]
    return {"workers": "" if r["workers"] is None else str(r["workers"]), "rate": fmt_rate(s["median"]),
            "range": f"({fmt_rate(s['min'])}-{fmt_rate(s['max'])})", "mbs": fmt_rate(r["mb_per_s"]["median"]),
            "speedup": "" if r["speedup_vs_folder"] is None else f"{r['speedup_vs_folder']:.2f}x",
            "eviction": None if r["eviction"] in (None, "verified") else f"eviction {r['eviction']}",
            "steady": _steady(r), "of_ceiling": _of_ceiling(r["fraction_of_ceiling"])}


def _of_ceiling(frac: float) -> str:
    """A fraction of the ceiling; above 100 % marked, for the note that says why it can be (``ceiling_note``)."""
    return f"{frac:.0%}" + ("*" if frac > 1.0 else "")


def _steady(r: dict) -> str:
    """Loader levels: the rate after the first batch (start-up left out) and its fraction of the ceiling."""
    st, frac = r.get("steady_samples_per_s"), r.get("steady_fraction_of_ceiling")
    return "" if st is None or frac is None else f"{fmt_rate(st['median'])} {_of_ceiling(frac)}"


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
    lines.append("  ceilings (the higher of before and after the passes): " + ceiling_summary(report["ceilings"]))
    nw = max([len("dataset"), *(len(r["name"]) for r in report["results"])])
    head = (f"{'dataset':<{nw}} {'level':<{LEVEL_WIDTH}} {'order':<10} {'cache':<5} {'wkr':>3} {'samples/s':>9} "
            f"{'(min-max)':<15} {'MB/s':>7} {'x folder':>8} {'of ceiling':>10} {'steady':>12}  ceiling")
    lines += ["", head, "-" * len(head)]
    prev = None
    for r in report["results"]:
        if prev is not None and (r["level"], r["dataset"]) != prev:
            lines.append("")
        prev = (r["level"], r["dataset"])
        c = _cells(r)
        lines.append(
            f"{r['name']:<{nw}} {r['level']:<{LEVEL_WIDTH}} {r['order']:<10} {r['cache']:<5} {c['workers']:>3} "
            f"{c['rate']:>9} {c['range']:<15} {c['mbs']:>7} {c['speedup']:>8} {c['of_ceiling']:>10} "
            f"{c['steady']:>12}  {r['ceiling']['name']}" + (f"  [{c['eviction']}]" if c["eviction"] else ""))
    lines.append("")
    lines.append(f"median of {report['options']['repeats']} repeats (min-max); steady: loader levels after their first "
                 "batch (start-up left out); samples per pass: "
                 + ", ".join(f"{Path(d['path']).name} {d['samples']}" for d in report["datasets"]))
    lines += [f"note: {note}" for note in table_notes(report)]
    lines.append(f"in short: {takeaway(report)}")
    return "\n".join(lines)


def table_notes(report: dict) -> list[str]:
    """What the figures need said beside them: which decoders ``x folder`` compares, why a fraction of the ceiling
    can pass 100 %, and how precise short emulated passes are."""
    return [n for n in (decoder_note(report), ceiling_note(report), emulation_note(report)) if n]


def _decoder_words(report: dict, decoder: str) -> str:
    """The library a bench decoder setting decodes JPEGs with in this run (``auto``: libjpeg-turbo where it loaded)."""
    turbo = (report["machine"].get("versions") or {}).get("libturbojpeg") == "loaded"
    return {"pil": "Pillow", "turbojpeg": "libjpeg-turbo", "auto": "libjpeg-turbo" if turbo else "Pillow"}.get(
        decoder, decoder)


def decoder_note(report: dict) -> str | None:
    """Where ``x folder`` compares decoders as well as containers: the loose folder decodes as ImageFolder does
    (Pillow), packed encoded datasets with their decoder; the decoders' own ratio, from this run's ceilings."""
    folder = next((d for d in report["datasets"] if d["kind"] == "folder"), None)
    if folder is None:
        return None
    decoding = {r["name"] for r in report["results"] if r["level"] != "read" and r["speedup_vs_folder"] is not None}
    packed = {d.get("decoder", "auto") for d in report["datasets"] if d["kind"] != "folder"
              and d["payload"] == "encoded" and Path(d["path"]).name in decoding}
    rates = {k: v["value"] for k, v in report["ceilings"].get("decode", {}).items()}
    ours = folder.get("decoder", "pil")
    theirs = _decoder_words(report, ours)
    differ = sorted(k for k in packed if _decoder_words(report, k) != theirs)
    if not differ:
        return None
    ratios = [f"{rates[k] / rates[ours]:.2f}x {theirs}'s rate per core"
              for k in differ if k in rates and ours in rates]
    return (f"beyond the read level, x folder includes the decoder: the folder decodes with {theirs} (as ImageFolder "
            f"does), packed encoded datasets with {', '.join(_decoder_words(report, k) for k in differ)}"
            + (f", {', '.join(ratios)} in this run's ceilings: divide by that for the container alone where decoding "
               "is the limit" if ratios else ""))


_ABOVE = {  # why a rate can pass its ceiling, by the ceiling's kind
    "memory copy": "memory copy: one 128 MiB copy through main memory, while payloads of a few hundred KB are copied "
                   "within the CPU's caches and zero-copy views (mapped files, raw pixels) are not copied at all",
    "sequential read": "cold sequential read: one fresh scratch file; data read before may come from a device or host "
                       "cache, and under --emulate a pass may run up to a throttle slice ahead",
    "decode": "decode: one core decoding samples of the first encoded dataset in memory; smaller images, or more "
              "threads than the level's count, decode faster",
}


def ceiling_note(report: dict) -> str | None:
    """Rates above their ceiling (marked ``*``) are not a measuring error: why each kind of ceiling can be passed."""
    above = [r for r in report["results"] if r["fraction_of_ceiling"] > 1.0
             or (r.get("steady_fraction_of_ceiling") or 0.0) > 1.0]
    kinds = sorted({k for r in above for k in _ABOVE if r["ceiling"]["name"].startswith(k)})
    if not above:
        return None
    busy = " On a busy machine a pass may also get more of the CPU than the ceiling's measurement did." if (
        busy_machine(report)) else ""
    return ("above 100 % of the ceiling (*): each ceiling is measured apart from the passes. "
            + "; ".join(_ABOVE[k] for k in kinds) + "." + busy)


def emulation_note(report: dict) -> str | None:
    """Under emulated storage, when cold passes last few throttle slices: by how much one slice moves their rate
    (on short passes as much as the difference between meeting a goal and missing it; docs/results.md)."""
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
                   f"| {c['rate']} {c['range']} | {c['mbs']} | {c['speedup']} | {c['of_ceiling']} "
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
    """One line with what the run shows, computed from its figures: what bounds the loose folder here (the disk,
    decoding, or the CPU when even its cold reads were on a CPU or waiting for one), how much faster than the
    folder the packed datasets of encoded images and of stored pixels are, and whether the machine was busy."""
    results = report["results"]
    levels = ("loader", "thread", "train", "thread-train", "decode", "read")  # the first one run speaks
    level = next((lv for lv in levels if any(r["level"] == lv for r in results)), None)
    if level is None:
        return "no measurements"
    rows = [r for r in results if r["level"] == level]
    payload = {Path(d["path"]).name: (d["kind"], d["payload"]) for d in report["datasets"]}
    folder = [r for r in results if payload.get(r["name"], ("", ""))[0] == "folder"]
    parts = [bound] if folder and level != "read" and (bound := _bound(folder, level)) else []
    differ = decoder_note(report) is not None and level != "read"
    for kind, words in (("encoded", "packed encoded images"), ("raw", "stored pixels")):
        ups = [r["speedup_vs_folder"] for r in rows if r["speedup_vs_folder"] is not None
               and payload.get(r["name"], ("", ""))[1] == kind and payload[r["name"]][0] != "folder"]
        if ups:
            parts.append(f"{words} {_span(ups)} the folder" + (" (container + decoder)" if differ and kind == "encoded"
                                                               else ""))
    if not parts:  # no folder in the run: how near the packed datasets come to their ceilings
        near = [r for r in rows if r.get("fraction_of_ceiling") is not None]
        if near:
            lo, hi = (f"{100 * f(r['fraction_of_ceiling'] for r in near):.0f}" for f in (min, max))
            names = sorted({r["ceiling"]["name"] for r in near})
            parts.append(f"{lo if lo == hi else f'{lo}-{hi}'} % of the ceiling ({', '.join(names)})")
    busy = busy_machine(report)
    parts += [busy] if busy else []
    return (f"{level} level: " if level != "decode" else "") + "; ".join(parts) if parts else f"{level} level"


def _cpu_share(rows: Sequence[dict], of: str = "both") -> float | None:
    """The share of these passes' wall time their thread spent on a CPU and waiting for one (``of="waiting"``:
    waiting only); None where the kernel did not say (``thread_cpu_seconds`` missing)."""
    cpu = [(c, s) for r in rows for c, s in zip(r.get("thread_cpu_seconds") or [], r.get("seconds") or [],
                                                strict=False)]
    wall = sum(s for _, s in cpu)
    if not cpu or wall <= 0:
        return None
    spent = sum(c["waiting_for_cpu"] + (c["on_cpu"] if of == "both" else 0.0) for c, _ in cpu)
    return min(spent / wall, 1.0)


def _bound(folder: list[dict], level: str) -> str | None:
    """What limits the loose folder: its cold reads against its cores' decoding, and whether those reads were held
    up by the disk or by the CPU (a busy machine: a pass waiting for a CPU is no measure of the disk)."""
    cold = [r for r in folder if r["level"] == "read" and r["cache"] == "cold"]
    ceiling = [r["ceiling"]["samples_per_s"] for r in folder if r["level"] == level]
    if not (cold and ceiling):
        return None
    rate, decode = min(r["samples_per_s"]["median"] for r in cold), max(ceiling)
    figures = f"(the folder reads {fmt_rate(rate)}+ samples/s cold, its cores decode {fmt_rate(decode)}/s)"
    if rate >= decode:
        return f"decode-bound here {figures}"
    share = _cpu_share(cold)
    if share is not None and share >= CPU_LIMITED:
        return (f"CPU-bound here, not IO-bound: the folder's cold reads ({fmt_rate(rate)} samples/s) were on a CPU or "
                f"waiting for one {share:.0%} of the time, held up by the disk {1 - share:.0%}")
    return f"IO-bound here {figures}"


def busy_machine(report: dict) -> str | None:
    """Other work on the machine: the share of their time the in-process passes (read, decode) waited for a CPU,
    or, where the kernel does not count that, the load when the run started (as ``packer doctor`` says it; a load
    the conversions before a run leave in the 1-minute average can make that one say busy when it is not)."""
    m = report["machine"]
    waiting = _cpu_share([r for r in report["results"] if r.get("thread_cpu_seconds")], of="waiting")
    if waiting is not None:
        if waiting < BUSY_WAIT:
            return None
        why = f"the read and decode passes waited for a CPU {waiting:.0%} of their time"
    else:
        cores, load = m.get("cores_usable") or 1, (m.get("load_average") or [0.0])[0]
        if load <= 0.8 * cores:
            return None
        why = f"load {load:.1f} on {cores} cores at the start"
    return f"the machine was busy ({why}): every rate is lower than on a quiet machine"
