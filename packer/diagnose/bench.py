"""``packer bench``: throughput of loose folders vs packed datasets, against the machine's ceilings.

For each dataset, level (``read``: bytes only; ``decode``: samples as training receives them;
``loader``: through a DataLoader; ``thread``: packed datasets through ``packer.ThreadLoader``, as many
threads as the setting's workers (the folder: the loader level's DataLoader); ``train``: a DataLoader of
RandomResizedCrop(224) + flip uint8 batches, the folder through Pillow as torchvision does it, packed
datasets in the fused ``crop`` mode; ``thread-train``: the same batches, packed datasets through a
ThreadLoader), order (``bench_sources.BENCH_ORDERS``) and page-cache state
(``cold``: every file of the dataset evicted before each repeat, checked with mincore; ``warm``:
after a full pass), it times ``repeats`` passes and reports the median with min-max, the speed-up
over the loose folder in the same setting, and the fraction of the relevant ceiling measured in
the same run on the same filesystem, optionally under a kernel block-IO throttle
(``throttle``) that emulates a slow device. How to read the figures: docs/bench.md.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from packer.diagnose import measure, system
from packer.diagnose.bench_sources import (
    BENCH_ORDERS,
    TRAIN_SIZE,
    BenchOrder,
    FolderSamples,
    FolderTrain,
    Source,
    list_collate,
    make_order,
    one_shape,
    open_source,
)
from packer.diagnose.reports import ceiling_summary, progress_line, table_notes
from packer.errors import PackerError
from packer.images.decode import pil_loader
from packer.read.hints import aheads_of, hinted_order
from packer.storage.url import refuse_urls

BENCH_LEVELS = ("read", "decode", "loader", "thread", "train", "thread-train")
LOADER_LEVELS = ("loader", "thread", "train", "thread-train")  # through a loader, with workers (thread: threads)
CACHE_STATES = ("cold", "warm")
WARMUP_SAMPLES = 32
BENCH_VERSION = 1
CEILING_BYTES = (32 << 20, 256 << 20)  # the cold-read scratch file sized to the data: at least, at most
DECODE_SAMPLES = 48  # stored images the decode ceiling is measured on, spread over the first encoded dataset
DECODE_SECONDS = 1.0  # per decoder, per measurement of the decode ceiling, when the data has more images than it


@dataclass
class BenchOptions:
    levels: Sequence[str] = ("read", "decode", "loader")  # "train" on request: it is the slowest
    orders: Sequence[str] = BENCH_ORDERS
    caches: Sequence[str] = CACHE_STATES
    workers: Sequence[int] = (0, 2)
    batch_size: int = 64
    pin_memory: bool = False
    repeats: int = 3
    limit: int | None = None
    seed: int = 0
    block_bytes: int | None = None  # block order: packer.read.sampler's defaults when None
    open_blocks: int | None = None
    run: int | None = None
    ceiling_bytes: int | None = None  # the cold-read ceiling's scratch file; None: sized to the data
    ceiling_seconds: float | None = None  # per decoder, per measurement of the decode ceiling; None: sized to the data
    emulate: str | None = None
    read_iops: int | None = None
    read_bps: int | None = None


def check_options(o: BenchOptions) -> None:
    """Every level, order and cache state asked is one bench knows, and each list is non-empty (local and URL)."""
    for name, given, allowed in (("level", o.levels, BENCH_LEVELS), ("order", o.orders, BENCH_ORDERS),
                                 ("cache", o.caches, CACHE_STATES)):
        bad = [v for v in given if v not in allowed]
        if bad or not given:
            raise PackerError(f"unknown or no {name} {bad or ''} (choose from {', '.join(allowed)})")
    if o.repeats < 1 or o.batch_size < 1 or (o.limit is not None and o.limit < 1):
        raise PackerError("--repeats, --batch-size and --limit must be at least 1")
    if any(w < 0 for w in o.workers) or not o.workers:
        raise PackerError("--workers takes counts >= 0, e.g. 0,2,4")
    if o.seed < 0:
        raise PackerError(f"--seed {o.seed}: expected 0 or more")
    for name, value in (("--block-size", o.block_bytes), ("--open-blocks", o.open_blocks), ("--run", o.run),
                        ("--ceiling-size", o.ceiling_bytes), ("--read-iops", o.read_iops), ("--read-bps", o.read_bps)):
        if value is not None and value < 1:
            raise PackerError(f"{name} {value}: expected at least 1")


# ------------------------------------------------------------------ one pass


def _payload_len(buf) -> int:
    """Bytes of one payload, after touching each of its pages: zero-copy views (memmap) are read only then."""
    arr = buf.reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.size:
        _ = int(arr[::4096].sum()) + int(arr[-1])  # one byte per 4 KiB page, and the last
    return int(arr.nbytes)


def _folder_pass(src: Source, level: str, order: BenchOrder) -> tuple[int, int]:
    """ImageFolder's way: one open + read (``read``) or one ``pil_loader`` (``decode``) per file."""
    nbytes = 0
    for i in order.indices.tolist():
        if level == "read":
            with open(src.paths[i], "rb") as fh:
                nbytes += len(fh.read())
        else:
            pil_loader(src.paths[i])
            nbytes += int(src.nbytes[i])
    return len(order.indices), nbytes


def _yielded(ds: Any, order: BenchOrder) -> Sequence[int]:
    """The order's public indices as a sampler yields them: in block order hinted with their blocks, as
    BlockShuffleSampler's are (packer.read.hints)."""
    public = ds.index_map.public_many(order.indices).tolist()
    return public if order.blocks is None else hinted_order(public, order.indices, order.blocks)


def _opened(handle: dict, key: str, open_: Callable[[], Any]) -> Any:
    """The dataset the warm-up pass opened, kept for every timed pass (a cold pass closes its files only, so
    the kernel can evict them): the timed passes measure reading and decoding, not opening again."""
    if key not in handle:
        handle[key] = open_()
    return handle[key]


def _packed_pass(src: Source, level: str, order: BenchOrder, handle: dict) -> tuple[int, int]:
    """packer's way: a batch at a time, as a DataLoader fetches it, without the DataLoader."""
    ds = _opened(handle, "ds", src.open)
    yielded = _yielded(ds, order)
    count = nbytes = 0
    for chunk in order.chunks:  # storage positions: "sequential" is the order on disk
        batch = [yielded[k] for k in range(count, count + len(chunk))]
        if level == "read":
            bufs = ds.payloads_at(chunk, aheads_of(batch))  # read ahead in file order, runs of neighbours together
            nbytes += sum(_payload_len(b) for b in bufs)
        else:
            bufs = ds.__getitems__(batch)
            nbytes += int(src.nbytes[chunk].sum())
        count += len(bufs)
    return count, nbytes


def _loader_pass(src: Source, order: BenchOrder, workers: int, batch_size: int, pin: bool,
                 handle: dict, train: bool = False, threads: bool = False) -> tuple[int, float | None]:
    """Through a DataLoader (``train``: fused RandomResizedCrop batches; ``threads``: packed datasets through
    a ThreadLoader of ``workers`` threads): (samples, seconds to the first batch)."""
    from packer.images.crop import RandomResizedCropDecode
    from packer.read.threaded import ThreadLoader

    t0 = time.perf_counter()
    loader: Any = None
    if src.kind == "folder":
        dataset, indices = (FolderTrain if train else FolderSamples)(src.paths, src.labels), order.indices.tolist()
    else:
        crop = RandomResizedCropDecode(TRAIN_SIZE) if train else None
        packed = _opened(handle, "tds", lambda: src.open("tensor", crop=crop))
        dataset, indices = packed, _yielded(packed, order)  # the order is of storage positions
        if threads:
            loader = ThreadLoader(packed, batch_size=batch_size, sampler=indices, num_threads=max(workers, 1),
                                  pin_memory=pin)
    if loader is None:
        stacked = train or one_shape(dataset)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=indices, num_workers=workers,
                            collate_fn=None if stacked else list_collate, pin_memory=pin)
    first, count = None, 0
    for images, _labels in loader:
        if first is None:
            first = time.perf_counter() - t0
        count += len(images)
    return count, first


def run_pass(src: Source, level: str, order: BenchOrder, workers: int, batch_size: int, pin: bool,
             handle: dict) -> tuple[int, int, float, float | None]:
    """One timed pass: (samples, bytes, seconds, seconds to the first batch or None)."""
    t0 = time.perf_counter()
    first = None
    if level in LOADER_LEVELS:
        count, first = _loader_pass(src, order, workers, batch_size, pin, handle, train=level.endswith("train"),
                                    threads=level.startswith("thread"))
        nbytes = int(src.nbytes[order.indices].sum())
    elif level in ("read", "decode"):
        if src.kind == "folder":
            count, nbytes = _folder_pass(src, level, order)
        else:
            count, nbytes = _packed_pass(src, level, order, handle)
    else:
        raise PackerError(f"unknown level {level!r} (choose {', '.join(BENCH_LEVELS)})")
    return count, nbytes, time.perf_counter() - t0, first


def _close(handle: dict) -> None:
    """Close readers so their mappings let the page cache go (mapped pages can't be evicted)."""
    for key in ("ds", "tds"):
        if key in handle:
            handle[key].close()


# ------------------------------------------------------------------ ceilings


def ceiling_sizes(sources: list[Source], o: BenchOptions) -> tuple[int, float]:
    """(scratch file bytes, seconds per decoder) of the ceilings: ``o``'s, else sized to the data: the cold-read
    scratch file as large as the largest dataset on disk (within ``CEILING_BYTES``), and the decode ceiling
    ``DECODE_SECONDS`` per decoder, or, when its samples are every image of the encoded datasets, 3 timed passes
    over them (each image decoded 3 times): rating passes over 5 MB of photos needs neither a 256 MB read nor
    seconds of decoding the same photos over and over."""
    nbytes = o.ceiling_bytes
    if nbytes is None:
        nbytes = int(min(CEILING_BYTES[1], max([CEILING_BYTES[0]] + [s.disk_bytes for s in sources])))
    seconds = o.ceiling_seconds
    if seconds is None:
        encoded = [s.n for s in sources if s.payload == "encoded"]
        seconds = 0.0 if encoded and max(encoded) <= DECODE_SAMPLES else DECODE_SECONDS
    return nbytes, seconds


def measure_ceilings(sources: list[Source], o: BenchOptions, log: Callable[[str], None]) -> dict:
    """Sequential read (cold) per filesystem, then the CPU ceilings (memory copy, per-core decode)."""
    ceilings: dict[str, Any] = {"sequential_read": {}}
    by_dev: dict[int, Path] = {}
    for s in sources:
        dev = os.stat(s.path).st_dev
        # The scratch file goes beside the dataset (same filesystem), else inside it.
        beside = s.path.parent if os.stat(s.path.parent).st_dev == dev and os.access(s.path.parent, os.W_OK) else s.path
        by_dev.setdefault(dev, beside)
    nbytes, seconds = ceiling_sizes(sources, o)
    for dev, target in by_dev.items():
        r = measure.sequential_read_ceiling(target, nbytes, repeats=max(2, min(o.repeats, 3)))
        ceilings["sequential_read"][str(dev)] = r.to_dict()
        log(f"ceiling: {r.name} {r.value:,.0f} MB/s ({r.detail})")
    ceilings.update(cpu_ceilings(sources, seconds))
    log(f"ceiling: memory copy {ceilings['memory_copy']['value']:,.0f} MB/s; "
        + ", ".join(f"{v['name']} {v['value']:,.0f} img/s" for v in ceilings["decode"].values()))
    return ceilings


def cpu_ceilings(sources: list[Source], seconds: float = DECODE_SECONDS) -> dict:
    """Memory copy bandwidth and the per-core rate of each decoder the datasets use (each of 3 timings at least
    one pass over the samples, and ``seconds`` in all)."""
    out: dict[str, Any] = {"memory_copy": measure.memory_copy_ceiling().to_dict(), "decode": {}}
    encoded = [s for s in sources if s.payload == "encoded"]
    if encoded:
        samples = encoded[0].decode_samples(DECODE_SAMPLES)
        for backend in sorted({s.decoder for s in encoded}):
            out["decode"][backend] = measure.decode_rate(samples, backend, seconds=seconds).to_dict()
    return out


def _best_of(first: dict, again: dict) -> dict:
    """CPU ceilings were measured before and after the passes: keep the higher (less disturbed) of each."""
    def pick(a: dict, b: dict) -> dict:
        best = dict(a if a["value"] >= b["value"] else b)
        best["runs"] = [a["value"], b["value"]]
        return best

    return {"memory_copy": pick(first["memory_copy"], again["memory_copy"]),
            "decode": {k: pick(v, again["decode"][k]) for k, v in first["decode"].items()}}


def _ceiling_for(src: Source, level: str, cache: str, workers: int | None, ceilings: dict, cores: int) -> dict:
    """The ceiling a result is measured against, as samples/s and MB/s, with its name."""
    mean = max(float(src.nbytes.mean()), 1.0) if src.n else 1.0
    io_name, io_mbs = ("memory copy", ceilings["memory_copy"]["value"]) if cache == "warm" else (
        "sequential read (cold)", ceilings["sequential_read"][str(os.stat(src.path).st_dev)]["value"])
    io = {"name": io_name, "mb_per_s": io_mbs, "samples_per_s": io_mbs * 1e6 / mean}
    if level == "read":
        return io
    procs = 1 if level == "decode" or not workers else min(workers, cores)
    if src.payload == "raw":
        dec = {"name": f"memory copy x{procs}", "samples_per_s": ceilings["memory_copy"]["value"] * 1e6 / mean * procs}
    else:
        rate = ceilings["decode"][src.decoder]["value"]
        dec = {"name": f"decode {src.decoder} x{procs} core{'s' if procs > 1 else ''}", "samples_per_s": rate * procs}
    dec["mb_per_s"] = dec["samples_per_s"] * mean / 1e6
    return dec if dec["samples_per_s"] <= io["samples_per_s"] else io


# ------------------------------------------------------------------ the run


def _settings(o: BenchOptions):
    """(level, order, cache, workers), each cold measurement followed by its warm one: the last cold
    pass has just filled the page cache, so the warm one needs no warm-up pass of its own."""
    for level in BENCH_LEVELS:
        if level not in o.levels:
            continue
        for order in o.orders:
            for w in (sorted(set(o.workers)) if level in LOADER_LEVELS else [None]):
                for cache in CACHE_STATES:
                    if cache in o.caches:
                        yield level, order, cache, w


def _report_head(sources: list[Source], o: BenchOptions) -> dict[str, Any]:
    return {
        "packer_bench": BENCH_VERSION,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": system.describe_machine(),
        "storage": {str(s.path): system.describe_storage(s.path) for s in sources},
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(o).items()},
        "datasets": [{"path": str(s.path), "kind": s.kind, "payload": s.payload, "decoder": s.decoder,
                      "samples": s.n, "payload_bytes": int(s.nbytes.sum()), "files": len(s.files),
                      "disk_bytes": s.disk_bytes} for s in sources],
        "emulation": None,
        "notes": [
            "cold: each dataset's files are evicted from the page cache before every repeat "
            "(fsync + posix_fadvise DONTNEED, checked with mincore); directory entries and inodes stay cached",
            "MB/s counts stored payload bytes (the original file bytes for encoded datasets)",
        ],
    }


def _measure_all(sources: list[Source], o: BenchOptions, thr, log: Callable[[str], None]) -> list[dict]:
    results = []
    for src in sources:
        orders = {k: make_order(k, src.nbytes, o.seed, o.block_bytes, o.open_blocks, o.batch_size, src.cuts, o.run,
                                src.blocks) for k in o.orders}
        previous, handle = None, {}
        for level, order_name, cache, w in _settings(o):
            prewarmed = cache == "warm" and previous == (level, order_name, "cold", w)
            handle = handle if prewarmed else {}  # a warm row after its cold one: the dataset that one opened
            row = measure_setting(src, level, order_name, orders[order_name], cache, w, o, thr, prewarmed, handle)
            previous = (level, order_name, cache, w)
            results.append(row)
            log(progress_line(row))
    return results


def run_bench(paths: Sequence[str | os.PathLike], options: BenchOptions | None = None,
              log: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark and return the report (JSON-able dict): machine, ceilings, one row per measurement."""
    from packer.diagnose.throttle import resolve_limits, throttled

    o = options or BenchOptions()
    check_options(o)
    log = log or (lambda s: None)
    if not paths:
        raise PackerError("give at least one folder or packed dataset to benchmark")
    refuse_urls("packer bench", *paths)
    sources = [open_source(p, o.limit) for p in paths]
    nbytes, seconds = ceiling_sizes(sources, o)
    o = replace(o, ceiling_bytes=nbytes, ceiling_seconds=seconds)  # the report's head records the sizes run
    emulating = bool(o.emulate or o.read_iops or o.read_bps)
    iops, bps, desc = resolve_limits(o.emulate, o.read_iops, o.read_bps)
    watched = [s.path for s in sources] + [s.path.parent for s in sources]
    ctx = throttled(watched, iops, bps) if emulating else nullcontext()
    report = _report_head(sources, o)
    cores = report["machine"]["cores_usable"] or 1
    with ctx as thr:
        if thr is not None:
            report["emulation"] = {"preset": o.emulate, "description": desc, **thr.describe()}
            log(f"emulating slow storage: {iops or 'unlimited'} read IOPS, "
                f"{bps / 1e6 if bps else 'unlimited'} MB/s on {', '.join(thr.describe()['devices'])}")
        report["ceilings"] = measure_ceilings(sources, o, log)
        report["results"] = _measure_all(sources, o, thr, log)
        # Other load on the machine lowers a ceiling measured once: measure the CPU ones again, keep the best.
        report["ceilings"].update(_best_of(report["ceilings"], cpu_ceilings(sources, seconds)))
        log("ceilings, the higher of before and after the passes (the table's): " + ceiling_summary(report["ceilings"]))
    for row in report["results"]:
        src = next(s for s in sources if str(s.path) == row["dataset"])
        row["ceiling"] = _ceiling_for(src, row["level"], row["cache"], row["workers"], report["ceilings"], cores)
        row["fraction_of_ceiling"] = row["samples_per_s"]["median"] / row["ceiling"]["samples_per_s"]
        if "steady_samples_per_s" in row:
            row["steady_fraction_of_ceiling"] = row["steady_samples_per_s"]["median"] / row["ceiling"]["samples_per_s"]
    _add_speedups(report["results"])
    report["notes"] += table_notes(report)  # the notes under the table: decoders, rates above a ceiling, emulation
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return report


def _stats(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}


def _eviction(cache: str, resident: list[float | None]) -> str | None:
    """How cold the cold passes were: verified, unverified (no mincore) or incomplete."""
    if cache != "cold":
        return None
    if any(r is None for r in resident):
        return "unverified"
    worst = max(r for r in resident if r is not None)
    return f"incomplete ({worst:.0%} stayed cached)" if worst > measure.COLD else "verified"


def _timed_repeats(src: Source, level: str, order: BenchOrder, cache: str, w: int, o: BenchOptions, thr,
                   handle: dict) -> dict:
    """``o.repeats`` passes, each from the page-cache state asked for; their figures, lists per repeat."""
    out: dict[str, Any] = {"seconds": [], "firsts": [], "resident": [], "device": [], "cpu": []}
    for _ in range(o.repeats):
        if cache == "cold":
            _close(handle)
            res = measure.evict(src.files)
        else:
            res = measure.residency(src.files)
        out["resident"].append(res.fraction)
        before, cpu = thr.read_counters() if thr is not None else None, measure.thread_cpu()
        out["count"], out["nbytes"], sec, first = run_pass(src, level, order, w, o.batch_size, o.pin_memory, handle)
        if cpu is not None and level not in LOADER_LEVELS and (now := measure.thread_cpu()) is not None:
            out["cpu"].append({"on_cpu": now[0] - cpu[0], "waiting_for_cpu": now[1] - cpu[1]})  # this thread's
        if thr is not None and before is not None:
            after = thr.read_counters()
            out["device"].append({"ios": after[0] - before[0], "bytes": after[1] - before[1]})
        out["seconds"].append(sec)
        out["firsts"].append(first)
    return out


def measure_setting(src: Source, level: str, order_name: str, order: BenchOrder, cache: str, workers: int | None,
                    o: BenchOptions, thr=None, prewarmed: bool = False, handle: dict | None = None) -> dict:
    """One row of the report: ``o.repeats`` timed passes of ``src`` at one level, order, cache state and worker
    count. ``handle``: the datasets opened for this setting (``prewarmed``: those its cold setting opened, so no
    timed pass opens one, its manifest and index evicted by that setting's last pass)."""
    handle = {} if handle is None else handle
    w = workers or 0
    try:
        # Warm-up: loads libraries and opens handles (and, for warm passes, fills the page cache). A warm
        # measurement right after its cold one starts from the cache that pass filled: its warm-up is one batch
        # that pass read last too, which opens the files again (the cold setting closed them) and reads nothing.
        # A head of the order warms up in this process: every timed pass starts its loader's workers afresh (a
        # forked worker inherits what this process loaded and opened), so starting workers for it measures nothing.
        head = order if cache == "warm" and not prewarmed else order.head(o.batch_size if prewarmed else WARMUP_SAMPLES)
        run_pass(src, level, head, w if head is order else 0, o.batch_size, o.pin_memory, handle)
        t = _timed_repeats(src, level, order, cache, w, o, thr, handle)
    finally:
        _close(handle)
    count, nbytes, seconds = t["count"], t["nbytes"], t["seconds"]
    row = {
        "dataset": str(src.path), "name": src.name, "kind": src.kind, "level": level, "order": order_name,
        "cache": cache, "workers": workers,
        "batch_size": o.batch_size if (level in LOADER_LEVELS or (level == "read" and src.kind != "folder")) else None,
        "samples": count, "bytes": nbytes, "seconds": seconds,
        "samples_per_s": _stats([count / max(s, 1e-9) for s in seconds]),
        "mb_per_s": _stats([nbytes / 1e6 / max(s, 1e-9) for s in seconds]),
        "resident_before": t["resident"], "eviction": _eviction(cache, t["resident"]),
    }
    if level in LOADER_LEVELS:
        # Worker start-up is part of every pass (and of every epoch); the steady rate leaves it out.
        row["seconds_to_first_batch"] = t["firsts"]
        first_n = min(o.batch_size, count)
        row["steady_samples_per_s"] = _stats([(count - first_n) / max(s - (f or 0), 1e-9)
                                              for s, f in zip(seconds, t["firsts"], strict=True)])
    if t["device"]:
        row["device_reads"] = t["device"]
    if t["cpu"]:
        row["thread_cpu_seconds"] = t["cpu"]  # the passing thread's time on a CPU and waiting for one, per repeat
    return row


def _add_speedups(results: list[dict]) -> None:
    """Speed-up of each row over the first loose folder's row in the same setting."""
    base = {}
    for r in results:
        if r["kind"] == "folder":
            base.setdefault((r["level"], r["order"], r["cache"], r["workers"]), r)
    for r in results:
        b = base.get((r["level"], r["order"], r["cache"], r["workers"]))
        r["speedup_vs_folder"] = (r["samples_per_s"]["median"] / b["samples_per_s"]["median"]) if b else None
