"""``packer bench``: throughput of loose folders vs packed datasets, against the machine's ceilings.

For each dataset, level (``read``: bytes only; ``decode``: samples as training receives them;
``loader``: through a DataLoader), order (``sequential``, uniform ``shuffle``, locality-preserving
``block``) and page-cache state (``cold``: every file of the dataset evicted before each repeat,
checked with mincore; ``warm``: after a full untimed pass), it times ``repeats`` passes and reports
the median with min-max as samples/s and MB/s, the speed-up over the loose folder in the same
setting, and the fraction of the relevant ceiling measured in the same run on the same filesystem
(cold sequential read of a large file, memory copy, per-core decode rate). Optionally the whole run
happens under a kernel block-IO throttle (``packer.throttle``) that emulates a slow device.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from packer import measure
from packer.errors import PackerError, under_way

LEVELS = ("read", "decode", "loader")
ORDERS = ("sequential", "shuffle", "block")
CACHES = ("cold", "warm")
WARMUP_SAMPLES = 32
BENCH_VERSION = 1


# ------------------------------------------------------------------ orders


@dataclass
class Order:
    """A sample order and the chunks the read and decode levels fetch together (batches, as a DataLoader would)."""

    kind: str
    indices: np.ndarray
    chunks: list[np.ndarray]
    blocks: np.ndarray | None = None  # block order: the blocks, for whole-block read-ahead

    def head(self, k: int) -> Order:
        first = self.indices[:k]
        return Order(self.kind, first, [first], self.blocks)


def make_order(kind: str, nbytes: np.ndarray, seed: int, block_bytes: int | None = None,
               open_blocks: int | None = None, batch_size: int = 64, cuts: Sequence[int] = (),
               run: int | None = None, blocks: np.ndarray | None = None) -> Order:
    """``sequential``, uniform ``shuffle``, or ``block``: packer.sampler's locality-preserving order
    (the format's own ``blocks`` unless ``block_bytes`` is given, else blocks of ``block_bytes`` cut
    at ``cuts`` (shard starts); windows of ``open_blocks`` blocks, runs of ``run`` neighbours; the
    sampler's defaults when None), exactly as BlockShuffleSampler yields it for one process in epoch 0."""
    from packer import sampler

    n = len(nbytes)
    bounds = None
    if kind == "sequential":
        idx = np.arange(n, dtype=np.int64)
    elif kind == "shuffle":
        idx = np.random.default_rng(seed).permutation(n).astype(np.int64)
    elif kind == "block":
        bounds = (np.asarray(blocks, dtype=np.int64) if blocks is not None and block_bytes is None else
                  sampler.block_boundaries(np.asarray(nbytes), block_bytes or sampler.DEFAULT_BLOCK_BYTES, cuts))
        idx = sampler.rank_order(bounds, 0, seed, open_blocks=open_blocks or sampler.DEFAULT_OPEN_BLOCKS,
                                 run=run or sampler.DEFAULT_RUN, batch_size=batch_size)
    else:
        raise PackerError(f"unknown order {kind!r} (choose {', '.join(ORDERS)})")
    step = max(batch_size, 1)
    return Order(kind, idx, [idx[s:s + step] for s in range(0, n, step)], bounds)


# ------------------------------------------------------------------ sources


def pil_loader(path: str) -> Image.Image:
    """torchvision ImageFolder's default loader."""
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


class FolderSamples(Dataset):
    """A loose folder read as ImageFolder reads it, returning CHW uint8 tensors (no transform)."""

    def __init__(self, paths: Sequence[str], labels: Sequence[int]) -> None:
        self.paths, self.labels = list(paths), list(labels)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        return torch.from_numpy(np.array(pil_loader(self.paths[i]))).permute(2, 0, 1), self.labels[i]


def list_collate(batch):
    """Images of different sizes can't be stacked without a transform: keep them as a list."""
    return [b[0] for b in batch], torch.tensor([b[1] for b in batch])


def _one_shape(dataset) -> bool:
    """Whether every image has one known size: then the loader level stacks batches (default_collate), as training would."""
    index = getattr(dataset, "index", None)
    if index is None or not len(index.heights):
        return False
    h, w = index.heights, index.widths
    return bool(h[0] > 0 and w[0] > 0 and np.all(h == h[0]) and np.all(w == w[0]))


@dataclass
class Source:
    """One dataset under test: a loose folder or a packed dataset, cut to ``limit`` samples."""

    path: Path
    kind: str  # "folder" or the packed format name
    payload: str  # "encoded" or "raw"
    decoder: str  # the decoder its decode level uses
    nbytes: np.ndarray  # payload bytes per sample (the first n)
    files: list[str]  # every file of the dataset: what a cold pass evicts
    paths: list[str] = field(default_factory=list)  # folder: absolute image paths
    labels: list[int] = field(default_factory=list)
    disk_bytes: int = 0  # bytes of all files of the dataset on disk
    cuts: tuple[int, ...] = ()  # shard starts after the first: blocks of the block order never span two
    blocks: np.ndarray | None = None  # the format's own blocks (one mosaic each), as BlockShuffleSampler takes them

    @property
    def n(self) -> int:
        return len(self.nbytes)

    @property
    def name(self) -> str:
        return self.path.name if self.kind == "folder" else f"{self.path.name}"

    def open(self, image: str = "numpy"):
        from packer.datasets import open_dataset

        return open_dataset(self.path, image=image, decoder=self.decoder)


def _packed_source(p: Path, m, limit: int | None) -> Source:
    from packer.formats import get_format
    from packer.index import Index

    idx = Index.load(p, m.num_samples)
    n = m.num_samples if limit is None else min(limit, m.num_samples)
    files = measure.tree_files(p)
    starts = np.cumsum([s.num_samples for s in m.shards])[:-1]
    own = getattr(get_format(m.format), "block_boundaries", None)
    blocks = None if own is None else own(m)
    blocks = None if blocks is None else np.append(blocks[blocks < n], n)
    return Source(p, m.format, m.payload, "auto", np.asarray(idx.nbytes[:n], dtype=np.int64), files,
                  disk_bytes=sum(os.path.getsize(f) for f in files), cuts=tuple(int(c) for c in starts if c < n),
                  blocks=blocks)


def open_source(path: str | os.PathLike, limit: int | None) -> Source:
    from packer.manifest import MANIFEST_NAME, read_manifest

    p = Path(path)
    if not p.exists():
        raise PackerError(f"{p}: no such folder or dataset")
    if (p / MANIFEST_NAME).exists():
        with under_way():  # a dataset failing its checks: the data is bad (exit 1), not the command line
            m = read_manifest(p)
            return _packed_source(p, m, limit)
    from packer.scan import scan_folder

    scan = scan_folder(p)
    n = len(scan.rel_paths) if limit is None else min(limit, len(scan.rel_paths))
    paths = [os.path.join(p, r) for r in scan.rel_paths[:n]]
    all_paths = [os.path.join(p, r) for r in scan.rel_paths]
    nbytes = np.array([os.path.getsize(f) for f in paths], dtype=np.int64)
    return Source(p, "folder", "encoded", "pil", nbytes, all_paths, paths=paths,
                  labels=[int(v) for v in list(scan.labels)[:n]], disk_bytes=int(nbytes.sum()))


# ------------------------------------------------------------------ passes


def _payload_len(buf) -> int:
    """Bytes of one payload, after touching each of its pages: zero-copy views (memmap) are read only then."""
    arr = buf.reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if arr.size:
        _ = int(arr[::4096].sum()) + int(arr[-1])  # one byte per 4 KiB page, and the last
    return int(arr.nbytes)


def _run_pass(src: Source, level: str, order: Order, workers: int, batch_size: int, pin: bool,
              handle: dict) -> tuple[int, int, float, float | None]:
    """One timed pass: (samples, bytes, seconds, seconds to the first batch or None)."""
    idx = order.indices.tolist()
    t0 = time.perf_counter()
    first = None
    count = nbytes = 0
    if level in ("read", "decode") and src.kind == "folder":
        for i in idx:  # ImageFolder: one open + read per file
            if level == "read":
                with open(src.paths[i], "rb") as fh:
                    nbytes += len(fh.read())
            else:
                pil_loader(src.paths[i])
                nbytes += int(src.nbytes[i])
        count = len(idx)
    elif level in ("read", "decode"):
        ds = handle.setdefault("ds", src.open())
        ds.read_ahead_blocks(order.blocks)  # as BlockShuffleSampler tells its dataset; forgets blocks read before
        for chunk in order.chunks:
            chunk = chunk.tolist()
            if level == "read":
                bufs = ds.read_payloads(chunk)  # read ahead in file order, runs of neighbours together
                nbytes += sum(_payload_len(b) for b in bufs)
            else:
                bufs = ds.__getitems__(chunk)  # a DataLoader's batch fetch, without the DataLoader
                nbytes += int(src.nbytes[chunk].sum())
            count += len(bufs)
    elif level == "loader":
        dataset = FolderSamples(src.paths, src.labels) if src.kind == "folder" else handle.setdefault("tds", src.open("tensor"))
        if src.kind != "folder":
            dataset.read_ahead_blocks(order.blocks)
        loader = DataLoader(dataset, batch_size=batch_size, sampler=idx, num_workers=workers,
                            collate_fn=None if _one_shape(dataset) else list_collate, pin_memory=pin)
        for images, _labels in loader:
            if first is None:
                first = time.perf_counter() - t0
            count += len(images)
        nbytes = int(src.nbytes[order.indices].sum())
        del loader
    else:
        raise PackerError(f"unknown level {level!r} (choose {', '.join(LEVELS)})")
    return count, nbytes, time.perf_counter() - t0, first


def _close(handle: dict) -> None:
    """Close readers so their mappings let the page cache go (mapped pages can't be evicted)."""
    for key in ("ds", "tds"):
        if key in handle:
            handle[key].close()


def _stats(values: list[float]) -> dict:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}


# ------------------------------------------------------------------ the run


@dataclass
class BenchOptions:
    levels: Sequence[str] = LEVELS
    orders: Sequence[str] = ORDERS
    caches: Sequence[str] = CACHES
    workers: Sequence[int] = (0, 2)
    batch_size: int = 64
    pin_memory: bool = False
    repeats: int = 3
    limit: int | None = None
    seed: int = 0
    block_bytes: int | None = None  # block order: packer.sampler's defaults when None
    open_blocks: int | None = None
    run: int | None = None
    ceiling_bytes: int = 256 << 20
    ceiling_seconds: float = 1.0  # per decoder, per measurement of the decode ceiling
    emulate: str | None = None
    read_iops: int | None = None
    read_bps: int | None = None


def _check_options(o: BenchOptions) -> None:
    for name, given, allowed in (("level", o.levels, LEVELS), ("order", o.orders, ORDERS), ("cache", o.caches, CACHES)):
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


def _decode_samples(src: Source, k: int = 48) -> list[bytes]:
    """The first ``k`` stored payloads of a source, to measure the decoders on."""
    n = min(k, src.n)
    if src.kind == "folder":
        out = []
        for p in src.paths[:n]:
            with open(p, "rb") as fh:
                out.append(fh.read())
        return out
    ds = src.open()
    try:
        return [bytes(b) for b in ds.read_payloads(list(range(n)))]
    finally:
        ds.close()


def measure_ceilings(sources: list[Source], o: BenchOptions, log: Callable[[str], None]) -> dict:
    """Sequential read (cold) per filesystem, then the CPU ceilings (memory copy, per-core decode)."""
    ceilings: dict[str, Any] = {"sequential_read": {}}
    by_dev: dict[int, Path] = {}
    for s in sources:
        dev = os.stat(s.path).st_dev
        # The scratch file goes beside the dataset (same filesystem), else inside it.
        beside = s.path.parent if os.stat(s.path.parent).st_dev == dev and os.access(s.path.parent, os.W_OK) else s.path
        by_dev.setdefault(dev, beside)
    for dev, target in by_dev.items():
        r = measure.sequential_read_ceiling(target, o.ceiling_bytes, repeats=max(2, min(o.repeats, 3)))
        ceilings["sequential_read"][str(dev)] = r.to_dict()
        log(f"ceiling: {r.name} {r.value:,.0f} MB/s ({r.detail})")
    ceilings.update(cpu_ceilings(sources, o.ceiling_seconds))
    log(f"ceiling: memory copy {ceilings['memory_copy']['value']:,.0f} MB/s; "
        + ", ".join(f"{v['name']} {v['value']:,.0f} img/s" for v in ceilings["decode"].values()))
    return ceilings


def cpu_ceilings(sources: list[Source], seconds: float = 1.0) -> dict:
    """Memory copy bandwidth and the per-core rate of each decoder the datasets use."""
    out: dict[str, Any] = {"memory_copy": measure.memory_copy_ceiling().to_dict(), "decode": {}}
    encoded = [s for s in sources if s.payload == "encoded"]
    if encoded:
        samples = _decode_samples(encoded[0])
        for backend in sorted({s.decoder for s in encoded}):
            out["decode"][backend] = measure.decode_ceiling(samples, backend, min_seconds=seconds).to_dict()
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


def _settings(o: BenchOptions):
    """(level, order, cache, workers), each cold measurement followed by its warm one: the last cold
    pass has just filled the page cache, so the warm one needs no warm-up pass of its own."""
    for level in LEVELS:
        if level not in o.levels:
            continue
        for order in o.orders:
            for w in (sorted(set(o.workers)) if level == "loader" else [None]):
                for cache in CACHES:
                    if cache in o.caches:
                        yield level, order, cache, w


def run_bench(paths: Sequence[str | os.PathLike], options: BenchOptions | None = None,
              log: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark and return the report (JSON-able dict): machine, ceilings, one row per measurement."""
    from packer.throttle import resolve_limits, throttled

    o = options or BenchOptions()
    _check_options(o)
    log = log or (lambda s: None)
    if not paths:
        raise PackerError("give at least one folder or packed dataset to benchmark")
    sources = [open_source(p, o.limit) for p in paths]
    emulating = bool(o.emulate or o.read_iops or o.read_bps)
    iops, bps, desc = resolve_limits(o.emulate, o.read_iops, o.read_bps)
    ctx = throttled([s.path for s in sources] + [s.path.parent for s in sources], iops, bps) if emulating else nullcontext()
    report: dict[str, Any] = {
        "packer_bench": BENCH_VERSION,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": measure.describe_machine(),
        "storage": {str(s.path): measure.describe_storage(s.path) for s in sources},
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
    cores = report["machine"]["cores_usable"] or 1
    with ctx as thr:
        if thr is not None:
            report["emulation"] = {"preset": o.emulate, "description": desc, **thr.describe()}
            log(f"emulating slow storage: {iops or 'unlimited'} read IOPS, "
                f"{bps / 1e6 if bps else 'unlimited'} MB/s on {', '.join(thr.describe()['devices'])}")
        report["ceilings"] = measure_ceilings(sources, o, log)
        results = []
        for src in sources:
            orders = {k: make_order(k, src.nbytes, o.seed, o.block_bytes, o.open_blocks, o.batch_size, src.cuts, o.run,
                                 src.blocks)
                      for k in o.orders}
            previous = None
            for level, order_name, cache, w in _settings(o):
                prewarmed = cache == "warm" and previous == (level, order_name, "cold", w)
                row = _measure(src, level, order_name, orders[order_name], cache, w, o, thr, prewarmed)
                previous = (level, order_name, cache, w)
                results.append(row)
                log(format_row(row))
        report["results"] = results
        # Other load on the machine lowers a ceiling measured once: measure the CPU ones again, keep the best.
        report["ceilings"].update(_best_of(report["ceilings"], cpu_ceilings(sources, o.ceiling_seconds)))
        for row in results:
            src = next(s for s in sources if str(s.path) == row["dataset"])
            row["ceiling"] = _ceiling_for(src, row["level"], row["cache"], row["workers"], report["ceilings"], cores)
            row["fraction_of_ceiling"] = row["samples_per_s"]["median"] / row["ceiling"]["samples_per_s"]
    _add_speedups(report["results"])
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return report


def _measure(src: Source, level: str, order_name: str, order: Order, cache: str, workers: int | None,
             o: BenchOptions, thr, prewarmed: bool = False) -> dict:
    handle: dict = {}
    w = workers or 0
    try:
        # Warm-up: loads libraries and opens handles (and, for warm passes, fills the page cache).
        # (A warm measurement right after its cold one starts from the cache that pass filled.)
        if not prewarmed:
            warm_order = order if cache == "warm" else order.head(WARMUP_SAMPLES)
            _run_pass(src, level, warm_order, w, o.batch_size, o.pin_memory, handle)
        seconds, firsts, resident, device = [], [], [], []
        count = nbytes = 0
        for _ in range(o.repeats):
            if cache == "cold":
                _close(handle)
                res = measure.evict(src.files)
            else:
                res = measure.residency(src.files)
            resident.append(res.fraction)
            before = thr.read_counters() if thr is not None else None
            count, nbytes, sec, first = _run_pass(src, level, order, w, o.batch_size, o.pin_memory, handle)
            if before is not None:
                after = thr.read_counters()
                device.append({"ios": after[0] - before[0], "bytes": after[1] - before[1]})
            seconds.append(sec)
            firsts.append(first)
    finally:
        _close(handle)
    if cache == "cold":
        if any(r is None for r in resident):
            eviction = "unverified"
        elif max(resident) > 0.01:
            eviction = f"incomplete ({max(resident):.0%} stayed cached)"
        else:
            eviction = "verified"
    else:
        eviction = None
    row = {
        "dataset": str(src.path), "name": src.name, "kind": src.kind, "level": level, "order": order_name,
        "cache": cache, "workers": workers, "batch_size": o.batch_size if (level == "loader" or (level == "read" and src.kind != "folder")) else None,
        "samples": count, "bytes": nbytes, "seconds": seconds,
        "samples_per_s": _stats([count / max(s, 1e-9) for s in seconds]),
        "mb_per_s": _stats([nbytes / 1e6 / max(s, 1e-9) for s in seconds]),
        "resident_before": resident,
        "eviction": eviction,
    }
    if level == "loader":
        # Worker start-up is part of every pass (and of every epoch); the steady rate leaves it out.
        row["seconds_to_first_batch"] = firsts
        first_n = min(o.batch_size, count)
        row["steady_samples_per_s"] = _stats([(count - first_n) / max(s - (f or 0), 1e-9) for s, f in zip(seconds, firsts, strict=False)])
    if device:
        row["device_reads"] = device
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


# ------------------------------------------------------------------ output


def _fmt_rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def format_row(r: dict) -> str:
    s, m = r["samples_per_s"], r["mb_per_s"]
    w = "" if r["workers"] is None else f" w={r['workers']}"
    ev = "" if r["eviction"] in (None, "verified") else f"  [eviction {r['eviction']}]"
    return (f"{r['name']:<16} {r['level']:<6} {r['order']:<10} {r['cache']:<4}{w:<5} "
            f"{_fmt_rate(s['median']):>8} samples/s ({_fmt_rate(s['min'])}-{_fmt_rate(s['max'])})  "
            f"{_fmt_rate(m['median']):>7} MB/s{ev}")


def format_table(report: dict) -> str:
    """The human table: one line per measurement, grouped by level, with speed-up and fraction of ceiling."""
    lines = []
    mach = report["machine"]
    lines.append(f"packer bench: {mach['cpu']}, {mach['cores_usable']} cores, {mach['os']}")
    for path, st in report["storage"].items():
        lines.append(f"  {path}: {st['fstype']} on {st['device'] or st['source']} "
                     f"({'rotational' if st['rotational'] else 'non-rotational' if st['rotational'] is not None else 'unknown'}"
                     f", read-ahead {st['read_ahead_kb']} KB)")
    if report.get("emulation"):
        e = report["emulation"]
        lines.append(f"  EMULATED storage ({e['description']}): {e['read_iops'] or 'unlimited'} read IOPS, "
                     f"{(e['read_bps'] or 0) / 1e6:.0f} MB/s, kernel block-IO throttle on {', '.join(e['devices'])}")
    c = report["ceilings"]
    parts = [f"sequential read {v['value']:,.0f} MB/s" for v in c["sequential_read"].values()]
    parts.append(f"memory copy {c['memory_copy']['value']:,.0f} MB/s")
    parts += [f"decode {k} {v['value']:,.0f} img/s/core" for k, v in c["decode"].items()]
    lines.append("  ceilings: " + ", ".join(parts))
    head = (f"{'dataset':<16} {'level':<6} {'order':<10} {'cache':<5} {'wkr':>3} {'samples/s':>9} {'(min-max)':<15} "
            f"{'MB/s':>7} {'x folder':>8} {'of ceiling':>10}  ceiling")
    lines.append("")
    lines.append(head)
    lines.append("-" * len(head))
    prev = None
    for r in report["results"]:
        if prev is not None and (r["level"], r["dataset"]) != prev:
            lines.append("")
        prev = (r["level"], r["dataset"])
        s = r["samples_per_s"]
        sp = "" if r["speedup_vs_folder"] is None else f"{r['speedup_vs_folder']:.2f}x"
        w = "" if r["workers"] is None else str(r["workers"])
        flag = "" if r["eviction"] in (None, "verified") else f"  [eviction {r['eviction']}]"
        lines.append(
            f"{r['name'][:16]:<16} {r['level']:<6} {r['order']:<10} {r['cache']:<5} {w:>3} {_fmt_rate(s['median']):>9} "
            f"{'(' + _fmt_rate(s['min']) + '-' + _fmt_rate(s['max']) + ')':<15} {_fmt_rate(r['mb_per_s']['median']):>7} "
            f"{sp:>8} {r['fraction_of_ceiling']:>10.0%}  {r['ceiling']['name']}{flag}"
        )
    lines.append("")
    lines.append(f"median of {report['options']['repeats']} repeats (min-max); samples per pass: "
                 + ", ".join(f"{Path(d['path']).name} {d['samples']}" for d in report["datasets"]))
    return "\n".join(lines)


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def markdown_table(report: dict, levels: Sequence[str] | None = None) -> str:
    """The results as a Markdown table (for reports and the README)."""
    out = ["| dataset | level | order | cache | workers | samples/s (min-max) | MB/s | x folder | of ceiling | ceiling |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in report["results"]:
        if levels and r["level"] not in levels:
            continue
        s = r["samples_per_s"]
        sp = "" if r["speedup_vs_folder"] is None else f"{r['speedup_vs_folder']:.2f}x"
        ev = "" if r["eviction"] in (None, "verified") else f" (eviction {r['eviction']})"
        out.append(
            f"| {r['name']} | {r['level']} | {r['order']} | {r['cache']}{ev} | {'' if r['workers'] is None else r['workers']} "
            f"| {_fmt_rate(s['median'])} ({_fmt_rate(s['min'])}-{_fmt_rate(s['max'])}) | {_fmt_rate(r['mb_per_s']['median'])} "
            f"| {sp} | {r['fraction_of_ceiling']:.0%} | {r['ceiling']['name']} |"
        )
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
    c = report["ceilings"]
    lines.append("- ceilings (same run): " + ", ".join(
        [f"cold sequential read {x['value']:,.0f} MB/s ({x['low']:,.0f}-{x['high']:,.0f})" for x in c["sequential_read"].values()]
        + [f"memory copy {c['memory_copy']['value']:,.0f} MB/s"]
        + [f"decode {k} {x['value']:,.0f} img/s per core" for k, x in c["decode"].items()]))
    d = ", ".join(f"`{Path(x['path']).name}` {x['samples']} samples, {x['payload_bytes'] / 1e6:.0f} MB of payload, "
                  f"{x['files']} files, {x['disk_bytes'] / 1e6:.0f} MB on disk" for x in report["datasets"])
    lines.append(f"- datasets: {d}")
    o = report["options"]
    from packer import sampler

    blk = o.get("block_bytes") or sampler.DEFAULT_BLOCK_BYTES
    lines.append(f"- options: repeats {o['repeats']}, batch size {o['batch_size']}, block order (packer.sampler): "
                 f"{blk / 1e6:.0f} MB blocks, windows of {o.get('open_blocks') or sampler.DEFAULT_OPEN_BLOCKS} open blocks, "
                 f"runs of {o.get('run') or sampler.DEFAULT_RUN}, seed {o['seed']}, pin_memory {o['pin_memory']}")
    return "\n".join(lines)
