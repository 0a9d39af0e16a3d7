"""``packer bench URL``: a packed dataset read from object storage as training reads it, and what it cost the link.

Each pass opens the dataset by its URL (``open_dataset(URL, remote_mode=...)``: ``auto``, as training opens it,
reads ranges where the dataset records them, else whole shards; ``ranged`` or ``shard`` to compare) into a
cache directory, reads it through a DataLoader (``loader``) or ``ThreadLoader`` (``thread``) in the order asked
(``block``: ``BlockShuffleSampler``, which hands its pass to the reader so it fetches ahead), and reads the node
downloader's counters (packer/storage/downloader.py) before and after: bytes fetched per byte delivered, GETs per
sample, cache hits. ``cold``: a new temporary cache directory for each repeat (unless the user gives one: then
``given``), removed after it; ``warm``: a second pass through the cache the cold one filled. The time to the first
batch counts from the open, as a job's does. The ceiling is the lower of the link (its bandwidth in samples/s: the
emulated link's, else the one measured by ranged GETs after the passes, packer/diagnose/link.py) and the cores'
decode rate. How to read it: docs/bench.md.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import DataLoader, RandomSampler

from packer.diagnose import measure, system
from packer.diagnose.bench import DECODE_SECONDS
from packer.diagnose.bench_sources import list_collate, one_shape
from packer.errors import PackerError
from packer.storage.url import redact

if TYPE_CHECKING:
    from packer.read.dataset import RemoteMode

REMOTE_LEVELS = ("loader", "thread")
REMOTE_ORDERS = ("sequential", "shuffle", "block")
DECODE_SAMPLES = 48
COUNTERS = ("gets", "file_bytes", "fetched_bytes", "files", "file_hits", "hits", "requests", "evicted")


@dataclass
class Target:
    """One dataset at a URL, with what reaches it (``storage_options``: never printed) and, when emulated, the
    link it is served through (``link``: latency and bandwidth)."""

    url: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    link: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return redact(self.url)

    @property
    def name(self) -> str:
        return self.label.rstrip("/").rsplit("/", 1)[-1]


@dataclass
class RemoteOptions:
    cache_dir: str | None = None  # None: a new temporary folder per repeat (a cold cache)
    cache_limit: int | str = "20GB"
    measure_link: bool = True
    remote_mode: RemoteMode = "auto"  # open_dataset's: ranged where the dataset records ranges, else whole shards


def check_remote(o: Any) -> tuple[list[str], list[str]]:
    """The levels and orders a URL is benched at: loader levels only (the read and decode levels time the local
    files' bytes, which a URL has not)."""
    levels = [v for v in o.levels if v in REMOTE_LEVELS]
    bad = [v for v in o.orders if v not in REMOTE_ORDERS]
    if not levels:
        raise PackerError(f"on a URL, packer bench measures the levels {', '.join(REMOTE_LEVELS)} "
                          f"(asked: {', '.join(o.levels)})")
    if bad:
        raise PackerError(f"unknown order {bad} (choose from {', '.join(REMOTE_ORDERS)})")
    return levels, list(o.orders)


# ------------------------------------------------------------------ one pass


class _Recorded:
    """The sampler's indices as the loader draws them (in order: the first ``n`` are the first ``n`` delivered)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.seen = sampler, []

    def __iter__(self) -> Iterator[int]:
        for i in self.sampler:
            self.seen.append(int(i))
            yield i

    def __len__(self) -> int:
        return len(self.sampler)


def _sampler(ds: Any, order: str, batch_size: int, seed: int, block_bytes: int | None, open_blocks: int | None,
             run: int | None) -> Any:
    import torch

    from packer.read.sampler import DEFAULT_OPEN_BLOCKS, DEFAULT_RUN, BlockShuffleSampler

    if order == "block":
        return BlockShuffleSampler(ds, batch_size=batch_size, seed=seed, block_bytes=block_bytes,
                                   open_blocks=open_blocks or DEFAULT_OPEN_BLOCKS, run=run or DEFAULT_RUN)
    if order == "shuffle":
        return RandomSampler(range(len(ds)), generator=torch.Generator().manual_seed(seed))
    return range(len(ds))


def _delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, int]:
    return {k: int(after.get(k, 0)) - int(before.get(k, 0)) for k in COUNTERS}


def remote_pass(target: Target, cache_dir: Path, level: str, order: str, workers: int, o: Any,
                opts: RemoteOptions, keep: dict | None = None) -> dict[str, Any]:
    """One timed pass from the open to the last batch: seconds, seconds to open and to the first batch, samples and
    payload bytes delivered, and the node downloader's counters over the pass. ``keep``: filled with a few stored
    payloads (for the decode ceiling) and the dataset's description, read after the timing."""
    from packer.read.dataset import open_dataset
    from packer.read.threaded import ThreadLoader
    from packer.storage.downloader_client import DownloaderClient

    t0 = time.perf_counter()
    ds = open_dataset(target.url, cache_dir=cache_dir, cache_limit=opts.cache_limit,
                      storage_options=target.storage_options, image="tensor", remote_mode=opts.remote_mode)
    try:
        opened = time.perf_counter() - t0
        counters = DownloaderClient(cache_dir, None)  # the node's downloader the dataset started: its counts
        try:
            before = counters.stats()
            sampler = _Recorded(_sampler(ds, order, o.batch_size, o.seed, o.block_bytes, o.open_blocks, o.run))
            loader: Any = (ThreadLoader(ds, batch_size=o.batch_size, sampler=sampler, num_threads=max(workers, 1))
                           if level == "thread" else
                           DataLoader(ds, batch_size=o.batch_size, sampler=sampler, num_workers=workers,
                                      collate_fn=None if one_shape(ds) else list_collate))
            first, count = None, 0
            for _images, labels in loader:
                if first is None:
                    first = time.perf_counter() - t0
                count += len(labels)
                if o.limit is not None and count >= o.limit:
                    break
            seconds = time.perf_counter() - t0
            del loader  # its workers end before the counters are read
            after = counters.stats()
        finally:
            counters.close()
        delivered = sampler.seen[:count]
        nbytes = int(ds.index.nbytes[ds.index_map.stored_many(delivered)].sum()) if delivered else 0
        if keep is not None and not keep:
            keep.update(_describe(target, ds))
    finally:
        ds.close()
    return {"seconds": seconds, "open": opened, "first": first, "count": count, "nbytes": nbytes,
            "counters": _delta(before, after)}


def _describe(target: Target, ds: Any) -> dict[str, Any]:
    """The dataset's row in the report, and a few stored payloads of its first shard (for the decode ceiling)."""
    m = ds.manifest
    objects = sum(f.num_bytes for s in m.shards for f in s.files)
    first = m.shards[0].num_samples if m.shards else 0
    samples = ([bytes(b) for b in ds.read_payloads(ds.index_map.public_many(
        np.linspace(0, first - 1, min(DECODE_SAMPLES, first)).astype(np.int64)))]
        if m.payload == "encoded" and first else [])
    return {"row": {"path": target.label, "kind": m.format, "payload": m.payload, "decoder": "auto",
                    "samples": len(ds), "payload_bytes": int(ds.index.nbytes.sum()), "files": sum(
                        len(s.files) for s in m.shards), "object_bytes": objects, "shards": len(m.shards)},
            "decode_samples": samples, "largest_object": largest_object(m)}


def largest_object(m: Any) -> str:
    """The key of the manifest's largest shard file: what the link is measured with (no listing needed)."""
    return max((f for s in m.shards for f in s.files), key=lambda f: f.num_bytes).name


# ------------------------------------------------------------------ the run


@contextmanager
def _cache_dir(given: str | None) -> Iterator[Path]:
    if given is not None:
        yield Path(given)
        return
    tmp = Path(tempfile.mkdtemp(prefix="packer-bench-cache-"))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": float(min(values)), "max": float(max(values))}


def _row(target: Target, level: str, order: str, cache: str, workers: int, o: Any, passes: list[dict]) -> dict:
    """One row of the report from its repeated passes (the local rows' fields, and the link's)."""
    count, nbytes = passes[0]["count"], passes[0]["nbytes"]
    first_n = min(o.batch_size, count)
    seconds = [p["seconds"] for p in passes]
    fetched = [p["counters"]["file_bytes"] + p["counters"]["fetched_bytes"] for p in passes]
    return {
        "dataset": target.label, "name": target.name, "kind": "url", "level": level, "order": order,
        "cache": cache, "workers": workers, "batch_size": o.batch_size, "samples": count, "bytes": nbytes,
        "seconds": seconds, "samples_per_s": _stats([p["count"] / max(p["seconds"], 1e-9) for p in passes]),
        "mb_per_s": _stats([p["nbytes"] / 1e6 / max(p["seconds"], 1e-9) for p in passes]),
        "seconds_to_open": [p["open"] for p in passes],
        "seconds_to_first_batch": [p["first"] for p in passes],
        "steady_samples_per_s": _stats([(p["count"] - first_n) / max(p["seconds"] - (p["first"] or 0), 1e-9)
                                        for p in passes]),
        "fetched_bytes": fetched,
        "fetched_per_delivered_byte": _stats([f / max(p["nbytes"], 1) for f, p in zip(fetched, passes, strict=True)]),
        "gets": [p["counters"]["gets"] for p in passes],
        "requests_per_sample": _stats([p["counters"]["gets"] / max(p["count"], 1) for p in passes]),
        "cache_hits": [p["counters"]["file_hits"] + p["counters"]["hits"] for p in passes],
        "downloader": [p["counters"] for p in passes],
        "eviction": None, "speedup_vs_folder": None,
    }


def _measure_target(target: Target, levels: list[str], orders: list[str], o: Any, opts: RemoteOptions,
                    keep: dict, log: Callable[[str], None]) -> list[dict]:
    """Every setting of one dataset: per repeat a cold pass (a new cache) then, if asked, a warm one through it."""
    rows = []
    caches = [c for c in ("cold", "warm") if c in o.caches]
    for level in levels:
        for order in orders:
            for w in sorted(set(o.workers)):
                passes: dict[str, list[dict]] = {"cold": [], "warm": []}
                for _ in range(o.repeats):
                    with _cache_dir(opts.cache_dir) as where:
                        passes["cold"].append(remote_pass(target, where, level, order, w, o, opts, keep))
                        if "warm" in caches:
                            passes["warm"].append(remote_pass(target, where, level, order, w, o, opts))
                for cache in caches:
                    shown = "given" if cache == "cold" and opts.cache_dir is not None else cache
                    rows.append(_row(target, level, order, shown, w, o, passes[cache]))
                    log(remote_progress_line(rows[-1]))
    return rows


def run_remote_bench(targets: Sequence[Target], o: Any, opts: RemoteOptions | None = None,
                     log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Bench each dataset at a URL (``o``: ``packer.diagnose.bench.BenchOptions``); the report, as ``run_bench``'s
    with the link's figures added to each row."""
    from packer.diagnose.bench import check_options
    from packer.diagnose.link import measure_link

    check_options(o)
    opts = opts or RemoteOptions()
    log = log or (lambda s: None)
    levels, orders = check_remote(o)
    report: dict[str, Any] = {
        "packer_bench": 1, "remote": True, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": system.describe_machine(),
        "options": {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(o).items()},
                    "levels": levels, "orders": orders, "cache_dir": opts.cache_dir, "cache_limit": opts.cache_limit,
                    "remote_mode": opts.remote_mode,
                    "storage_option_keys": sorted({k for t in targets for k in t.storage_options})},
        "datasets": [], "results": [], "links": {}, "ceilings": {"decode": {}},
        "emulation": next((t.link for t in targets if t.link), None),
        "notes": ["time to the first batch counts from open_dataset(URL): a job's start (metadata fetched, "
                  "the node's downloader started)",
                  "fetched: bytes the node's downloader received from the store during the pass (shards, ranges); "
                  "delivered: payload bytes of the samples the loader returned",
                  "cache hits: requests the node's cache answered without a GET (in a cold pass: shards another "
                  "worker or the read-ahead had fetched)",
                  "cold: a new temporary cache directory per repeat; warm: a second pass through it"]}
    samples: list[bytes] = []
    for target in targets:
        keep: dict[str, Any] = {}
        report["results"] += _measure_target(target, levels, orders, o, opts, keep, log)
        report["datasets"].append(keep["row"])
        samples = samples or keep["decode_samples"]
        if opts.measure_link:
            link = measure_link(target.url, target.storage_options, keep["largest_object"])
            report["links"][target.label] = link
            log(f"link: {link['first_byte_s'] * 1e3:.1f} ms to the first byte, "
                f"{link['bandwidth_bytes_per_s'] / 1e6:,.0f} MB/s ({link['in_flight']} ranged GETs of "
                f"{link['range_bytes'] >> 10} KiB at once)")
    if samples:
        report["ceilings"]["decode"]["auto"] = measure.decode_rate(
            samples, "auto", seconds=DECODE_SECONDS if o.ceiling_seconds is None else o.ceiling_seconds).to_dict()
    for row in report["results"]:
        row["ceiling"] = remote_ceiling(report, row)
        row["fraction_of_ceiling"] = row["samples_per_s"]["median"] / row["ceiling"]["samples_per_s"]
        row["steady_fraction_of_ceiling"] = row["steady_samples_per_s"]["median"] / row["ceiling"]["samples_per_s"]
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return report


def remote_ceiling(report: dict, row: dict) -> dict[str, Any]:
    """The lower of the link (bytes that cross it per sample: the dataset's objects over its samples; not for a warm
    pass, which fetches nothing) and the cores' decode rate, as samples/s, with its name; ``bound``: which one."""
    ds = next(d for d in report["datasets"] if d["path"] == row["dataset"])
    per_sample = ds["object_bytes"] / max(ds["samples"], 1)
    emu, measured = report.get("emulation"), report["links"].get(row["dataset"])
    bandwidth = (emu or {}).get("bandwidth_bytes_per_s") or (measured or {}).get("bandwidth_bytes_per_s")
    out: dict[str, Any] = {"name": "unknown", "samples_per_s": float("inf"), "bound": None}
    if bandwidth and row["cache"] != "warm":
        source = "emulated" if (emu or {}).get("bandwidth_bytes_per_s") else "measured"
        out = {"name": f"link {bandwidth / 1e6:,.0f} MB/s ({source})", "samples_per_s": bandwidth / per_sample,
               "bound": "link"}
    rate = report["ceilings"]["decode"].get("auto")
    if rate and ds["payload"] == "encoded":
        cores = report["machine"]["cores_usable"] or 1
        procs = max(1, min(row["workers"] or 1, cores))
        dec = rate["value"] * procs
        if dec < out["samples_per_s"]:
            out = {"name": f"decode x{procs} core{'s' if procs > 1 else ''}", "samples_per_s": dec, "bound": "decode"}
    out["mb_per_s"] = out["samples_per_s"] * per_sample / 1e6
    return out


# ------------------------------------------------------------------ text


def remote_progress_line(r: dict) -> str:
    first = np.median([f for f in r["seconds_to_first_batch"] if f is not None] or [float("nan")])
    return (f"{r['name']:<16} {r['level']:<7} {r['order']:<10} {r['cache']:<5} w={r['workers']:<3} "
            f"{r['samples_per_s']['median']:>8,.0f} samples/s, steady {r['steady_samples_per_s']['median']:,.0f}, "
            f"first batch {first:.2f} s, fetched/delivered {r['fetched_per_delivered_byte']['median']:.2f}, "
            f"GETs/sample {r['requests_per_sample']['median']:.3f}, cache hits {int(np.median(r['cache_hits']))}")


def remote_table(report: dict) -> str:
    """The human table of a URL bench: one line per measurement with the link's figures and the ceiling."""
    mach = report["machine"]
    lines = [f"packer bench: {mach['cpu']}, {mach['cores_usable']} cores, {mach['os']}"]
    if report.get("emulation"):
        e = report["emulation"]
        lines.append(f"  EMULATED object store ({e.get('preset') or 'custom'}): {e['latency_s'] * 1e3:g} ms to the "
                     f"first byte, {(e['bandwidth_bytes_per_s'] or 0) / 1e6:,.0f} MB/s link, {e['server']}")
    for url, link in report["links"].items():
        lines.append(f"  link to {url}: {link['first_byte_s'] * 1e3:.1f} ms to the first byte, "
                     f"{link['bandwidth_bytes_per_s'] / 1e6:,.0f} MB/s measured")
    head = (f"{'dataset':<16} {'level':<7} {'order':<10} {'cache':<5} {'wkr':>3} {'samples/s':>9} {'steady':>8} "
            f"{'1st batch':>9} {'fetched/deliv':>13} {'GETs/sample':>11} {'hits':>5} {'of ceiling':>10}  ceiling")
    lines += ["", head, "-" * len(head)]
    for r in report["results"]:
        first = np.median([f for f in r["seconds_to_first_batch"] if f is not None] or [float("nan")])
        lines.append(
            f"{r['name']:<16} {r['level']:<7} {r['order']:<10} {r['cache']:<5} {r['workers']:>3} "
            f"{r['samples_per_s']['median']:>9,.0f} {r['steady_samples_per_s']['median']:>8,.0f} {first:>8.2f}s "
            f"{r['fetched_per_delivered_byte']['median']:>13.2f} {r['requests_per_sample']['median']:>11.3f} "
            f"{int(np.median(r['cache_hits'])):>5} {r['steady_fraction_of_ceiling']:>10.0%}  {r['ceiling']['name']}")
    lines.append("")
    lines.append(f"median of {report['options']['repeats']} repeats; steady: after the first batch; of ceiling: the "
                 "steady rate over the lower of the link and the decode ceiling")
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


# ------------------------------------------------------------------ emulated


@contextmanager
def emulated_targets(paths: Sequence[str], preset: str | None, latency: float | None,
                     bandwidth: float | None) -> Iterator[list[Target]]:
    """Local packed datasets served through the emulated object store (each folder's parent, in a child process,
    with ``preset``'s latency and bandwidth unless given) as ``s3://packer/<name>`` targets."""
    from contextlib import ExitStack

    from packer.diagnose.link import LINK_PRESETS, EmulatedLink
    from packer.layout.manifest import MANIFEST_NAME
    from packer.storage.url import is_url

    base = LINK_PRESETS[preset] if preset else None
    lat = latency if latency is not None else (base.latency if base else 0.0)
    bw = bandwidth if bandwidth is not None else (base.bandwidth if base else None)
    with ExitStack() as stack:
        targets = []
        for p in paths:
            if is_url(p):
                raise PackerError(f"{redact(p)}: --emulate serves a local packed dataset; give its folder")
            folder = Path(p).resolve()
            if not (folder / MANIFEST_NAME).is_file():
                raise PackerError(f"{p}: not a packed dataset (no {MANIFEST_NAME}); --emulate "
                                  f"{preset or 'with a link'} serves packed datasets")
            link = stack.enter_context(EmulatedLink(folder.parent, lat, bw))
            targets.append(Target(link.url(folder.name), link.storage_options,
                                  {**link.describe(), "preset": preset, "source": base.source if base else None}))
        yield targets
