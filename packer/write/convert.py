"""The conversion driver: scan -> plan shards -> prepare in a process pool -> write -> index -> manifest.

Worker processes read, validate and (for raw payloads) decode the source files; the main
process writes shards in dataset order, so the output depends only on the source and the
options, never on ``workers``. Everything goes into ``<out>.partial`` and is renamed to
``<out>`` after the manifest is written, so an interrupted run never leaves an output that
looks complete. Every source file is either packed or listed in ``errors.json``.

Nothing the run did not make is deleted: the output may not be, hold or lie inside the source;
``--overwrite`` replaces only a packer dataset, moved into a fresh ``<out>.packer-old-*`` folder
(journaled, so ``--resume`` finishes a swap killed half-way) and deleted once the new one is in
place; a ``.partial`` is reused or removed only when its journal shows packer made it.
"""

from __future__ import annotations

import errno
import itertools
import json
import mmap
import multiprocessing
import os
import secrets
import shutil
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from packer._random import stable_permutation
from packer._version import __version__
from packer.errors import PackerError, ResumableError
from packer.formats import FORMATS, get_format
from packer.formats.base import Format, PreparedSample
from packer.images.decode import DecodeError, check_pixels, decode
from packer.images.headers import image_size
from packer.images.resize import ResizeSpec
from packer.layout.fsutil import fsync_dir, fsync_tree, write_atomic
from packer.layout.index import Index
from packer.layout.manifest import (
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    PAYLOADS,
    Manifest,
    Shard,
    dumps_lossless,
    file_info,
    holds_dataset,
    read_manifest,
    write_manifest,
)
from packer.layout.partial import JOURNAL_DIR, OLD_TAG, PLAN_NAME, made_by_packer, read_swap
from packer.layout.trust import open_regular
from packer.write.journal import (
    ShardResult,
    SourceError,
    load_done_shards,
    read_plan,
    record_shard,
    scan_digest,
    write_plan,
    write_swap,
)
from packer.write.scan import ScanResult, scan_folder

Validate = Literal["full", "header", "none"]
Order = Literal["shuffled", "source"]
ORDERS = ("shuffled", "source")
DEFAULT_ORDER: Order = "shuffled"  # see docs/sampling.md: label mixing for block-shuffled reads
NEW_TAG = ".packer-new-"  # <out>.packer-new-<pid>-<random>: a new .partial until its plan is written
ERRORS_NAME = "errors.json"
_CHUNK = 16  # files per pool task: amortises IPC without hurting ordering latency
# Chunks in flight per worker: enough that the workers keep going while this process pauses to
# commit a batch or close a shard (4 left them idle half the time), few enough to bound memory.
_AHEAD = 16
_AHEAD_BYTES = 256 << 20  # ... and at most about this much prepared payload waiting (raw pixels are large)
_RING_BYTES = 256 << 20  # at most this much shared ring for payloads from forked workers (0: pickle them)


@dataclass
class ConvertOptions:
    """Everything that decides the bytes of the output (recorded in the manifest, see ``record``)."""

    format: str = "lmdb"
    payload: str = "encoded"
    validate: Validate = "full"
    shard_bytes: int | None = None  # None: the format's default
    resize: str | None = None  # "S" or "HxW" (raw payloads only; lossy, explicit)
    resize_mode: str = "stretch"  # for HxW: stretch, or fit (keep aspect, pad)
    upscale: bool = False
    compression: str | None = None  # a codec of the format's ``compressions`` (hdf5: lzf, gzip), raw payloads only
    decoder: str = "auto"
    order: Order = DEFAULT_ORDER  # sample order in the dataset: a seeded shuffle, or the scan's (ImageFolder's)
    seed: int = 0  # of the shuffled order
    extra: dict[str, Any] = field(default_factory=dict)  # the format's own options (Format.options), by name

    def record(self) -> dict[str, Any]:
        """The options as the manifest and the journal record them: flat, the format's own by name, no decoder."""
        common = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("decoder", "extra")}
        return {**common, **{o.name: self.extra.get(o.name) for o in get_format(self.format).options}}

    @classmethod
    def from_record(cls, record: dict[str, Any], where: object = "manifest") -> ConvertOptions:
        """The options a manifest recorded (``record``'s inverse, ``decoder`` allowed); unknown non-empty entries
        are refused (old manifests list every format's options, empty where not given)."""
        common = {f.name for f in fields(cls)} - {"extra"}
        fmt = get_format(str(record.get("format")))
        own = {o.name for o in fmt.options}
        unknown = sorted(k for k, v in record.items() if k not in common | own and v is not None)
        if unknown:
            raise PackerError(f"{where}: unknown conversion option(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in record.items() if k in common},
                   extra={k: v for k, v in record.items() if k in own})

    @property
    def resize_spec(self) -> ResizeSpec | None:
        size = self.resize or get_format(self.format).implied_resize(self.record())
        return ResizeSpec.parse(size, self.resize_mode, self.upscale)

    def check(self) -> None:
        fmt = get_format(self.format)
        if self.payload not in PAYLOADS:
            raise PackerError(f"unknown payload {self.payload!r} (choose from {', '.join(PAYLOADS)})")
        if self.payload not in fmt.payloads:
            raise PackerError(f"format {self.format!r} stores only {', '.join(sorted(fmt.payloads))} payloads")
        fmt.check_options(self.record())
        if self.validate not in ("full", "header", "none"):
            raise PackerError(f"unknown validation level {self.validate!r} (choose full, header or none)")
        if self.shard_bytes is not None and self.shard_bytes <= 0:
            raise PackerError("shard size must be positive")
        if self.resize_spec is not None and self.payload != "raw":
            raise PackerError("--resize changes pixels, so it needs --payload raw (encoded payloads keep the source bytes)")
        if self.compression is not None:
            if self.compression not in fmt.compressions:
                raise PackerError(f"--compression {self.compression}: format {self.format!r} offers "
                                  f"{', '.join(sorted(fmt.compressions)) or 'no compression'}")
            if self.payload != "raw":
                raise PackerError("--compression applies to raw payloads only: encoded JPEG/PNG bytes are "
                                  "already compressed and would not shrink (use --payload raw, or drop --compression)")
        if self.order not in ORDERS:
            raise PackerError(f"unknown sample order {self.order!r} (choose {' or '.join(ORDERS)})")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise PackerError(f"the order seed must be a non-negative integer, got {self.seed!r}")


def make_options(to: str, **given: Any) -> ConvertOptions:
    """ConvertOptions for format ``to`` from keyword fields and the format's own options, refusing unknown names."""
    fmt = get_format(to)
    common = {f.name for f in fields(ConvertOptions)} - {"format", "extra"}
    own = {o.name: o for o in fmt.options}
    others = {o.name: f.name for f in FORMATS.values() if f is not fmt for o in f.options}
    for key in sorted(set(given) - common - set(own)):
        if key in others:
            if given[key] is None:
                continue
            raise PackerError(f"--{key} is an option of --to {others[key]} only")
        known = ", ".join(sorted(common | set(own)))
        raise PackerError(f"unknown conversion option {key!r} for --to {to} (known: {known})")
    if given.get("payload") is None:
        given["payload"] = "encoded" if "encoded" in fmt.payloads else "raw"
    if given.get("resize") is not None:  # sizes may come as numbers (resize=256)
        given["resize"] = str(given["resize"])
    extra = {k: (str(v) if own[k].type is None and v is not None else v) for k, v in given.items() if k in own}
    return ConvertOptions(format=to, extra=extra, **{k: v for k, v in given.items() if k in common})


@dataclass
class ConvertResult:
    output: Path
    num_samples: int
    errors: list[SourceError]
    seconds: float
    bytes_read: int
    ignored: dict[str, int] = field(default_factory=dict)

    @property
    def files_per_second(self) -> float:
        return (self.num_samples + len(self.errors)) / max(self.seconds, 1e-9)


# ---------------------------------------------------------------- worker side


def prepare(root: Path, rel: str, label: int, options: ConvertOptions) -> PreparedSample | SourceError:
    """Read one source file and make its payload; a problem becomes a SourceError, never an exception."""
    path = root / rel
    try:
        data, source_stat = read_source(path)
    except OSError as exc:
        if not path.exists() and path.is_symlink():
            return SourceError(rel, "broken symbolic link")
        return SourceError(rel, f"cannot read: {exc.strerror or exc}")
    if not data:
        return SourceError(rel, "empty file (0 bytes)")
    try:
        if options.payload == "raw":
            pixels = decode(data, options.decoder, strict=True)
            spec = options.resize_spec
            if spec is not None:
                pixels = spec.apply(pixels)
            h, w = pixels.shape[:2]
            return PreparedSample(-1, rel, label, np.ascontiguousarray(pixels), h, w, source_stat)
        if options.validate == "full":
            h, w = decode(data, options.decoder, strict=True).shape[:2]
        elif options.validate == "header":
            h, w = image_size(data)
            check_pixels(h, w)  # what a decode would refuse is refused here too, from the header
        else:
            h, w = 0, 0  # unknown: not looked at (readers then refuse an image above the pixel limit)
    except DecodeError as exc:
        return SourceError(rel, str(exc))
    except Exception as exc:  # a codec crash on hostile bytes must not abort the conversion
        return SourceError(rel, f"cannot decode image: {type(exc).__name__}: {exc}")
    return PreparedSample(-1, rel, label, data, h, w, source_stat)


def read_source(path: Path) -> tuple[bytes, list[int]]:
    """The whole file and its [size, mtime_ns] as read; OSError for a special file or one that changes meanwhile.

    Opened by ``open_regular`` (a FIFO would block forever); a change of size or mtime during the
    read means the bytes may mix two versions, so they are refused rather than packed.
    """
    fd, st = open_regular(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read()
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if len(data) != st.st_size and st.st_size != 0:
        raise OSError(errno.EAGAIN, f"changed while being read ({st.st_size} bytes, then {len(data)})")
    if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
        raise OSError(errno.EAGAIN, "changed while being read (modified meanwhile)")
    return data, [st.st_size, st.st_mtime_ns]


def _prepare_chunk(root: Path, items: list[tuple[str, int]], options: ConvertOptions,
                   slot: tuple[int, int] | None = None) -> tuple[list, list]:
    """Prepare ``items``; with a ring ``slot`` (offset, size) payloads travel through the shared ring.

    Returns the results and, per result, where its payload lies in the ring: ``(offset, nbytes,
    shape)``, or None where it travels pickled (errors; payloads that do not fit the slot).
    """
    results = [prepare(root, rel, label, options) for rel, label in items]
    where: list = [None] * len(results)
    if slot is None or _RING is None:
        return results, where
    offset, end = slot[0], slot[0] + slot[1]
    for i, res in enumerate(results):
        if isinstance(res, PreparedSample) and offset + res.nbytes <= end:
            payload, nbytes = res.payload, res.nbytes
            _RING[offset : offset + nbytes] = payload if isinstance(payload, bytes) else payload.data
            where[i] = (offset, nbytes, None if isinstance(payload, bytes) else payload.shape)
            res.payload = b""
            offset += nbytes
    return results, where


# The shared ring of a fork-started pool, inherited by its workers (set by their initializer).
_RING: mmap.mmap | None = None


def _init_worker(ring: mmap.mmap | None) -> None:
    global _RING
    _RING = ring
    # A killed parent (SIGKILL) can't stop its pool: a worker waiting for work would wait forever.
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _from_ring(ring: mmap.mmap, results: list, where: list) -> list:
    """Copy the payloads out of the ring (the slot is reused as soon as this returns)."""
    for res, loc in zip(results, where):
        if loc is not None:
            offset, nbytes, shape = loc
            data = ring[offset : offset + nbytes]  # a copy, as bytes
            res.payload = data if shape is None else np.frombuffer(data, np.uint8).reshape(shape).copy()
    return results


# ---------------------------------------------------------------- planning


def default_output(src: Path, fmt: str) -> Path:
    src = Path(os.path.abspath(src))
    return src.with_name(f"{src.name}.{fmt}")


def estimate_sample_bytes(scan: ScanResult, options: ConvertOptions, probes: int = 64) -> float:
    """Mean payload size from a deterministic sample of the sources (no full stat pass)."""
    n = len(scan)
    picks = sorted({int(i) for i in np.linspace(0, n - 1, num=min(n, probes))})
    sizes = []
    for i in picks:
        path = scan.root / scan.rel_paths[i]
        try:
            if options.payload == "raw":
                fd, _ = open_regular(path)  # never blocks on a FIFO
                try:
                    h, w = image_size(os.read(fd, 1 << 20))
                finally:
                    os.close(fd)
                spec = options.resize_spec
                if spec is not None:
                    h, w = spec.output_shape(h, w)
                sizes.append(h * w * 3)
            else:
                sizes.append(path.stat().st_size)
        except (OSError, DecodeError):
            continue
    return float(np.mean(sizes)) if sizes else 1.0


def plan_shards(num_files: int, mean_bytes: float, shard_bytes: int | None, multiple: int = 1) -> list[tuple[int, int]]:
    """Split source positions into (start, stop) runs of roughly ``shard_bytes`` each.

    ``multiple``: a format's natural unit (mosaic: tiles per mosaic); shards holding more than
    one are rounded down to whole units, so only a shard's last unit can be partly filled.
    """
    if shard_bytes is None:
        return [(0, num_files)]
    per_shard = max(1, int(shard_bytes // max(mean_bytes, 1.0)))
    if per_shard > multiple > 1:
        per_shard -= per_shard % multiple
    return [(s, min(s + per_shard, num_files)) for s in range(0, num_files, per_shard)]


def shard_multiple(options: ConvertOptions) -> int:
    """The format's natural unit of samples per shard (1 for most; mosaic: tiles per mosaic)."""
    return int(get_format(options.format).shard_multiple(options.record()))


def apply_order(scan: ScanResult, order: str, seed: int) -> ScanResult:
    """The scan with its samples in dataset order: as found (ImageFolder's), or a seeded shuffle.

    The permutation depends only on (seed, number of files), never on ``workers``, and comes
    from numpy's stable PCG64 stream, so the same seed gives the same bytes everywhere.
    """
    if order == "source":
        return scan
    perm = stable_permutation(len(scan), seed)
    return replace(scan, rel_paths=[scan.rel_paths[i] for i in perm], labels=scan.labels[perm])


def check_free_space(directory: Path, needed: float) -> None:
    free = shutil.disk_usage(directory).free
    if needed * 1.05 > free:
        raise PackerError(
            f"{directory}: not enough free disk space: the output needs about {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB free (choose another --output, or --resize for raw payloads)"
        )


# ---------------------------------------------------------------- driver


def _ordered_results(
    root: Path, items: list[tuple[str, int]], options: ConvertOptions, workers: int, mean_bytes: float = 0.0
) -> Iterator[PreparedSample | SourceError]:
    """Prepared samples in source order; a bounded number of chunks in flight keeps memory flat."""
    ahead = max(2, min(_AHEAD, int(_AHEAD_BYTES // max(1.0, workers * _CHUNK * mean_bytes))))
    chunks = [items[i : i + _CHUNK] for i in range(0, len(items), _CHUNK)]
    if workers <= 0:
        for chunk in chunks:
            yield from _prepare_chunk(root, chunk, options)[0]
        return
    ctx = multiprocessing.get_context()
    # Forked workers inherit a shared ring: payloads cross by one copy each way instead of pickles
    # through a pipe. Other start methods can't inherit it and fall back to pickling.
    slots = workers * ahead  # one per chunk in flight: a slot is free again once its chunk is popped
    slot_bytes = int(min(2 * _CHUNK * max(mean_bytes, 1 << 16), _RING_BYTES // slots)) & ~4095
    ring = mmap.mmap(-1, slots * slot_bytes) if ctx.get_start_method() == "fork" and slot_bytes else None
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                                 initargs=(ring,)) as pool:
            pending: deque[Future] = deque()
            try:
                for n, chunk in enumerate(chunks):
                    slot = None if ring is None else ((n % slots) * slot_bytes, slot_bytes)
                    pending.append(pool.submit(_prepare_chunk, root, chunk, options, slot))
                    if len(pending) >= slots:
                        yield from _received(ring, pending.popleft())
                while pending:
                    yield from _received(ring, pending.popleft())
            finally:
                for f in pending:
                    f.cancel()
    finally:
        if ring is not None:
            ring.close()


def _received(ring: mmap.mmap | None, future: Future) -> list:
    results, where = future.result()
    return results if ring is None else _from_ring(ring, results, where)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="img", disable=not enabled, dynamic_ncols=True, smoothing=0.1,
                desc="packing", file=sys.stderr)


def convert(
    src: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    to: str = "lmdb",
    on_error: Literal["skip", "raise"] = "skip",
    workers: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool = True,
    client: Any = None,
    **options: Any,
) -> ConvertResult:
    """Pack the images of folder ``src`` into a dataset of format ``to``; see ``packer convert --help``.

    ``options`` are the fields of ``ConvertOptions`` (``payload``, ``validate``, ``shard_bytes``,
    ``resize``, ``order``, ``tile``, ...): everything that decides the output's bytes, recorded in
    the manifest. ``payload`` defaults to ``encoded`` where the format stores it, else ``raw``
    (bmp, mosaic). With a Dask ``client`` the class folders are scanned and the shards written by
    the cluster's workers (packer.write.cluster; source and output on storage they share); the
    bytes are the same. ``overwrite`` replaces an existing packer dataset (nothing else);
    ``resume`` goes on with an interrupted run's ``<out>.partial``.
    """
    options = make_options(to, **options)
    options.check()
    if on_error not in ("skip", "raise"):
        raise PackerError(f"unknown error policy {on_error!r} (choose skip or raise)")
    fmt = get_format(to)
    if options.shard_bytes is None:
        options.shard_bytes = fmt.default_shard_bytes
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise PackerError(f"workers {workers!r}: expected a count >= 0 (0: in this process; None: all cores)")
    workers = os.cpu_count() or 1 if workers is None else workers
    out = output_path(src, output, to)
    check_destination(src, out, overwrite)

    started = time.perf_counter()
    if client is None:
        scanned = scan_folder(src)
    else:
        from packer.write.cluster import scan_on_cluster

        scanned = scan_on_cluster(client, src)
    scan = apply_order(scanned, options.order, options.seed)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    plan = _load_or_make_plan(scan, out, partial, options, resume)
    try:
        if read_swap(partial, out)[0]:  # a finished conversion whose move into place was interrupted
            return _complete_swap(scan, partial, out, started)
        shards = _write_shards(scan, partial, out, plan, fmt, options, on_error, workers, progress, client)
        return _finish(scan, partial, out, shards, options, started)
    except OSError as exc:  # the journal, meta/*.npy, errors.json, the manifest or the renames
        raise _failed_midway(f"{exc.filename or out}: {exc.strerror or exc}", partial) from exc
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupted(partial)) from None


def output_path(src: str | os.PathLike, output: str | os.PathLike | None, fmt: str) -> Path:
    """The absolute output path: ``output``, or ``<src>.<fmt>`` beside the source; an empty one is refused."""
    if output is None:
        return default_output(Path(src), fmt)
    if os.fspath(output) == "":
        raise PackerError("the output path is empty: name the dataset folder to create (-o DIR)")
    return Path(os.path.abspath(output))


def check_destination(src: str | os.PathLike, out: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, an output whose replacement would destroy data.

    The output may not be the source, hold it or lie inside it (symlinks followed); an existing
    path is replaced only when it holds a packer dataset, and then only with ``overwrite``.
    """
    source, target = Path(os.path.realpath(src)), Path(os.path.realpath(out))
    if target == source:
        raise PackerError(f"{out}: is the source folder itself; choose another --output")
    if source.is_relative_to(target):
        raise PackerError(f"{out}: holds the source folder {src}; choose an --output that does not contain it")
    if target.is_relative_to(source):
        raise PackerError(f"{out}: lies inside the source folder {src}; choose an --output outside it")
    if not os.path.lexists(out):
        return
    if not holds_dataset(out):
        raise PackerError(f"{out}: exists and is {_describe(out)}, not a packer dataset; packer replaces only a "
                          f"dataset, even with --overwrite: choose another --output, or move it away yourself")
    if not overwrite:
        raise PackerError(f"{out}: already exists (use --overwrite to replace it)")


def _describe(path: Path) -> str:
    if path.is_symlink() and not path.exists():
        return "a broken symbolic link"
    if path.is_file():
        return "a file"
    if path.is_dir():
        return f"a folder without a packer {MANIFEST_NAME}"
    return "a special file"


def _fresh_name(out: Path, tag: str) -> Path:
    """A name beside ``out`` no earlier run used: ``<out><tag><pid>-<random>`` (made exclusively by the caller)."""
    return out.with_name(f"{out.name}{tag}{os.getpid()}-{secrets.token_hex(4)}")


def _failed_midway(message: str, partial: Path) -> PackerError:
    """The error for a failure after the output was started: resumable while ``partial`` holds the work."""
    if not made_by_packer(partial):
        return PackerError(message)
    return ResumableError(f"{message}; the work done so far is kept in {partial}: free space (or fix the "
                          f"problem), then run the same command with --resume")


def _interrupted(partial: Path) -> str:
    """What a Ctrl-C leaves: the message the CLI prints (once) as ``packer: ...``."""
    if not made_by_packer(partial):
        return "interrupted"
    return (f"interrupted; the work done so far is kept in {partial}: run the same command with --resume "
            f"to go on, or remove it")


def _write_shards(scan, partial, out, plan, fmt, options, on_error, workers, progress, client) -> list[ShardResult]:
    """Every planned shard, reusing the journaled ones: written here (a process pool) or on a Dask cluster."""
    ranges = [(int(a), int(b)) for a, b in plan["shards"]]
    done = load_done_shards(partial, len(ranges), scan.root)
    try:
        if client is None:
            results = _build_shards(scan, partial, plan, done, fmt, options, on_error, workers, progress)
        else:
            from packer.write.cluster import build_shards

            results = build_shards(client, scan, partial, ranges, done, options, on_error, progress)
    except ShardWriteError as exc:
        raise _failed_midway(f"{out}: {exc}", partial) from exc
    except PackerError:  # a bad source file under --on-error raise: nothing worth resuming
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return [results[i] for i in range(len(ranges))]


def _load_or_make_plan(scan: ScanResult, out: Path, partial: Path, options: ConvertOptions, resume: bool) -> dict:
    """The shard plan: the journaled one when resuming, else a new one (written before any shard).

    An existing ``partial`` is used only when its journal shows packer made it, and never
    deleted here: one that packer did not make is refused, naming it.
    """
    recorded = options.record()
    digest = scan_digest(scan)
    if os.path.lexists(partial):
        plan = read_plan(partial)
        if plan is None:
            raise PackerError(f"{partial}: exists but was not made by packer (it holds no {JOURNAL_DIR}/{PLAN_NAME}), "
                              f"so packer leaves it alone: move it away, or choose another --output")
        if not resume:
            raise PackerError(_leftover(partial, out))
        if plan.get("options") != recorded or plan.get("digest") != digest:
            raise PackerError(
                f"{partial}: the source files or the options changed since the interrupted run, so it "
                f"can't be resumed; remove it (rm -r '{partial}') and convert again"
            )
        return plan
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PackerError(f"{exc.filename or out.parent}: cannot create the output's folder ({exc.strerror or exc})") from exc
    mean_bytes = estimate_sample_bytes(scan, options)
    check_free_space(out.parent, mean_bytes * len(scan))
    plan = {"options": recorded, "digest": digest, "source": str(scan.root), "num_files": len(scan),
            "shards": plan_shards(len(scan), mean_bytes, options.shard_bytes, shard_multiple(options)),
            "mean_bytes": mean_bytes}
    _make_partial(out, partial, plan)
    return plan


def _leftover(partial: Path, out: Path) -> str:
    """Why a packer-made ``partial`` blocks a run without --resume, and the ways out."""
    swapping, trash = read_swap(partial, out)
    if not swapping:
        return (f"{partial}: left over from an interrupted conversion; go on with it by running the same "
                f"command with --resume, or remove it (rm -r '{partial}')")
    old = out.with_name(trash) / out.name if trash else None
    where = f"the old dataset was moved to {old.parent}" if old is not None and os.path.lexists(old) \
        else f"{out} is not replaced yet"
    return (f"{partial}: holds the complete result of an interrupted conversion that was being moved into place "
            f"({where}); run the same command with --resume to finish that (nothing is converted again)")


def _make_partial(out: Path, partial: Path, plan: dict) -> None:
    """Create ``partial`` holding ``plan``: made under a fresh name and renamed once the plan is on disk,
    so a ``.partial`` without a plan is never one of packer's."""
    tmp = _fresh_name(out, NEW_TAG)
    try:
        os.mkdir(tmp)
        try:
            write_plan(tmp, plan)
            os.rename(tmp, partial)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(out.parent)
    except OSError as exc:
        raise PackerError(f"{exc.filename or partial}: cannot create the output ({exc.strerror or exc})") from exc


class ShardWriteError(PackerError):
    """Writing a shard failed (disk full, I/O error): the conversion can be resumed."""


def write_shard(
    partial: Path, shard_id: int, planned: int, samples: Iterable[PreparedSample | SourceError],
    fmt: Format, options: ConvertOptions, on_error: str, root: Path,
    on_each: Callable[[PreparedSample | SourceError], None] | None = None,
) -> tuple[ShardResult, list[str]]:
    """Write one shard from its prepared samples (in order); returns its metadata and file names."""
    result = ShardResult(shard_id, Shard(num_samples=0, files=[]))
    try:
        writer = fmt.Writer(partial, shard_id, planned, options.payload, options.record())
    except PackerError:
        raise
    except Exception as exc:  # ENOSPC, EIO, the storage engine's own errors (lmdb.DiskError is no OSError)
        raise ShardWriteError(f"cannot create shard {shard_id} ({exc})") from exc
    try:
        for res in samples:
            if on_each is not None:
                on_each(res)
            if isinstance(res, SourceError):
                if on_error == "raise":
                    raise PackerError(f"{root / res.path}: {res.reason}")
                result.errors.append(res)
                continue
            res.index = len(result.rel_paths)  # position inside the shard
            try:
                writer.add(res)
            except PackerError:
                raise
            except Exception as exc:  # ENOSPC, EIO, the storage engine's own errors
                raise ShardWriteError(_write_failure(partial, shard_id, exc)) from exc
            result.rel_paths.append(res.rel_path)
            result.labels.append(res.label)
            result.heights.append(res.height)
            result.widths.append(res.width)
            result.nbytes.append(res.nbytes)
            result.stats.append(res.source_stat)
        try:
            names, facts = writer.close()
        except PackerError:
            raise
        except Exception as exc:
            raise ShardWriteError(_write_failure(partial, shard_id, exc)) from exc
    except BaseException:
        writer.abort()
        raise
    result.shard.num_samples = len(result.rel_paths)
    result.shard.facts = facts
    return result, names


def _write_failure(partial: Path, shard_id: int, exc: Exception) -> str:
    """Say why a write failed; storage engines often report a full disk as a plain I/O error."""
    msg = f"writing shard {shard_id} failed ({exc})"
    try:
        free = shutil.disk_usage(partial).free
    except OSError:
        return msg
    if free < (64 << 20) or getattr(exc, "errno", None) == errno.ENOSPC:
        msg += f": the disk is full ({free / 1e6:.1f} MB free)"
    return msg


def _build_shards(scan, partial, plan, done, fmt, options, on_error, workers, progress) -> dict[int, ShardResult]:
    """Write every shard not yet done: a process pool prepares samples, this process writes them in order."""
    ranges = [(int(a), int(b)) for a, b in plan["shards"]]
    todo = [(sid, a, b) for sid, (a, b) in enumerate(ranges) if sid not in done]
    items = [(scan.rel_paths[i], int(scan.labels[i])) for _, a, b in todo for i in range(a, b)]
    results = dict(done)
    bar = _progress(len(scan), progress)
    bar.update(sum(b - a for sid, (a, b) in enumerate(ranges) if sid in done))
    written = [0]

    def on_each(res) -> None:
        bar.update(1)
        if isinstance(res, PreparedSample):
            written[0] += res.nbytes
        if bar.n % 64 == 0:
            bar.set_postfix_str(f"{written[0] / 1e6 / max(bar.format_dict['elapsed'], 1e-9):.0f} MB/s")

    prepared = _ordered_results(scan.root, items, options, workers, float(plan.get("mean_bytes", 0.0)))
    journaler = ThreadPoolExecutor(max_workers=1)  # checksums + journal of a shard while the next is written
    pending: dict[int, Future] = {}
    try:
        for sid, a, b in todo:
            result, names = write_shard(partial, sid, b - a, itertools.islice(prepared, b - a), fmt, options,
                                        on_error, scan.root, on_each)
            pending[sid] = journaler.submit(record_shard, partial, result, names)
        prepared.close()  # the pool winds down while the last shard is checksummed
        for sid, future in pending.items():
            results[sid] = future.result()
    finally:
        bar.close()
        prepared.close()
        journaler.shutdown(wait=True, cancel_futures=True)
    return results


def _finish(scan: ScanResult, partial: Path, out: Path, shards: list[ShardResult], options: ConvertOptions,
            started: float) -> ConvertResult:
    """Index, error report and manifest (last), then the renames that make the dataset exist."""
    cat = lambda name: [v for r in shards for v in getattr(r, name)]  # noqa: E731
    index = Index.build(cat("rel_paths"), cat("labels"), cat("heights"), cat("widths"), cat("nbytes"))
    errors: list[SourceError] = cat("errors") + scan.errors
    meta_files = [file_info(partial, n) for n in index.save(partial)]
    write_atomic(partial / ERRORS_NAME, dumps_lossless(
        {"num_errors": len(errors), "ignored": dict(scan.ignored),
         "errors": [asdict(e) for e in sorted(errors, key=lambda e: e.path)]},
        indent=1,
    ))
    if errors:
        print(f"packer: {len(errors)} of {len(scan)} files not packed, see {ERRORS_NAME}:", file=sys.stderr)
        for e in errors[:10]:
            print(f"  {e.path}: {e.reason}", file=sys.stderr)
        if len(errors) > 10:
            print(f"  ... and {len(errors) - 10} more", file=sys.stderr)
    manifest = Manifest(
        format=options.format,
        payload=options.payload,
        num_samples=len(index),
        classes=list(scan.classes),
        shards=[r.shard for r in shards],
        meta_files=meta_files,
        options=options.record(),
        num_errors=len(errors),
        source=str(scan.root),
        created_by=f"packer {__version__}",
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    fsync_tree(partial)
    write_manifest(partial, manifest)
    _swap_into_place(partial, out)
    return ConvertResult(out, len(index), errors, time.perf_counter() - started, int(index.nbytes.sum()),
                         dict(scan.ignored))


def _complete_swap(scan: ScanResult, partial: Path, out: Path, started: float) -> ConvertResult:
    """Finish the move into place that a killed run journaled: its output is complete, nothing is converted."""
    num_samples = read_manifest(partial).num_samples
    path = partial / ERRORS_NAME
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        errors = [SourceError(str(e["path"]), str(e["reason"])) for e in report["errors"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PackerError(f"{path}: damaged error report ({exc}); move {partial} away and convert again") from exc
    print(f"packer: {partial} holds a finished conversion; moving it into place", file=sys.stderr)
    _swap_into_place(partial, out)
    return ConvertResult(out, num_samples, errors, time.perf_counter() - started, 0, dict(scan.ignored))


def _swap_into_place(partial: Path, out: Path) -> None:
    """Rename the finished ``partial`` to ``out``; an old output (--overwrite) is moved aside only now.

    The swap is journaled first, naming the fresh folder the old output goes into, so a run
    killed between the two renames is finished by --resume, and only that folder is deleted.
    Readers that already opened the old dataset keep reading its (unlinked) files.
    """
    swapping, name = read_swap(partial, out)
    if not swapping:
        name = _fresh_name(out, OLD_TAG).name if os.path.lexists(out) else None
        write_swap(partial, name)
    trash = out.with_name(name) if name else None
    if os.path.lexists(out):
        if trash is None:
            raise PackerError(f"{out}: appeared while {partial} was being moved there; move it away, then run "
                              f"the same command with --resume")
        _set_aside(out, trash)
    os.rename(partial, out)
    fsync_dir(out.parent)
    _remove_leftovers(out, trash)


def _set_aside(out: Path, trash: Path) -> None:
    """Move ``out`` into the new folder ``trash`` (made here, or empty: made by a run killed right after)."""
    try:
        os.mkdir(trash)
    except FileExistsError:
        if trash.is_symlink() or not trash.is_dir() or os.listdir(trash):
            raise PackerError(f"{trash}: exists and is not the empty folder packer made, so {out} is not moved "
                              f"into it; move one of them away, then run the same command with --resume") from None
    os.rename(out, trash / out.name)


def _remove_leftovers(out: Path, trash: Path | None) -> None:
    """Delete the old output's folder (if it holds nothing else) and the journal; failing only warns."""
    leftovers = [out / JOURNAL_DIR]
    if trash is not None and trash.is_dir() and not trash.is_symlink():
        if set(os.listdir(trash)) <= {out.name}:
            leftovers.insert(0, trash)
        else:
            print(f"packer: warning: {trash} holds more than the old {out.name}; left alone", file=sys.stderr)
    for path in leftovers:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            print(f"packer: warning: {out} is in place, but {exc.filename or path} could not be removed "
                  f"({exc.strerror or exc}); remove it yourself", file=sys.stderr)
