"""The conversion driver: scan -> plan shards -> prepare in a process pool -> write -> index -> manifest.

Worker processes read, validate and (for raw payloads) decode the source files; the main
process writes shards in dataset order, so the output depends only on the source and the
options, never on ``workers``. Everything goes into ``<out>.partial`` and is renamed to
``<out>`` after the manifest is written, so an interrupted run never leaves an output that
looks complete. Every source file is either packed or listed in ``errors.json``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from packer import __version__
from packer.decode import DecodeError, decode
from packer.errors import PackerError
from packer.formats import FORMATS, get_format
from packer.formats.base import PreparedSample
from packer.headers import image_size
from packer.index import Index
from packer.manifest import PAYLOADS, Manifest, Shard, file_info, write_manifest
from packer.resize import ResizeSpec
from packer.scan import ScanResult, scan_folder

Validate = Literal["full", "header", "none"]
PARTIAL_SUFFIX = ".partial"
ERRORS_NAME = "errors.json"
_CHUNK = 16  # files per pool task: amortises IPC without hurting ordering latency


@dataclass
class ConvertOptions:
    """Everything that decides the bytes of the output (recorded in the manifest)."""

    format: str = "lmdb"
    payload: str = "encoded"
    validate: Validate = "full"
    shard_bytes: int | None = None  # None: the format's default
    resize: str | None = None  # "S" or "HxW" (raw payloads only; lossy, explicit)
    resize_mode: str = "stretch"  # for HxW: stretch, or fit (keep aspect, pad)
    upscale: bool = False
    decoder: str = "auto"
    tile: str | None = None  # mosaic: "HxW" every image is resized to (implies --resize HxW)
    grid: str | None = None  # mosaic: "RxC" tiles per mosaic (None: about 16 MB decoded)
    codec: str | None = None  # mosaic: bmp (default), png or jpeg (lossy)
    quality: int | None = None  # mosaic jpeg quality (default 95)

    @property
    def resize_spec(self) -> ResizeSpec | None:
        return ResizeSpec.parse(self.tile or self.resize, self.resize_mode, self.upscale)

    def check(self) -> None:
        fmt = get_format(self.format)
        if self.payload not in PAYLOADS:
            raise PackerError(f"unknown payload {self.payload!r} (choose from {', '.join(PAYLOADS)})")
        if self.payload not in fmt.PAYLOADS:
            raise PackerError(f"format {self.format!r} stores only {', '.join(sorted(fmt.PAYLOADS))} payloads")
        if hasattr(fmt, "check_options"):
            fmt.check_options(asdict(self))
        if self.validate not in ("full", "header", "none"):
            raise PackerError(f"unknown validation level {self.validate!r} (choose full, header or none)")
        if self.shard_bytes is not None and self.shard_bytes <= 0:
            raise PackerError("shard size must be positive")
        for name, module in FORMATS.items():  # format-specific options (e.g. mosaic's --tile) stay with their format
            for key in getattr(module, "OPTIONS", ()):
                if name != self.format and getattr(self, key) is not None:
                    raise PackerError(f"--{key} is an option of --to {name} only")
        if self.resize_spec is not None and self.payload != "raw":
            raise PackerError("--resize changes pixels, so it needs --payload raw (encoded payloads keep the source bytes)")
        if self.tile is not None and self.resize is not None and \
                ResizeSpec.parse(self.tile).fixed_shape != ResizeSpec.parse(self.resize).fixed_shape:
            raise PackerError(f"--tile {self.tile} already sets the size; drop --resize {self.resize}")


@dataclass
class SourceError:
    path: str  # relative to the source folder
    reason: str


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
        data = read_source(path)
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
            return PreparedSample(-1, rel, label, np.ascontiguousarray(pixels), h, w)
        if options.validate == "full":
            h, w = decode(data, options.decoder, strict=True).shape[:2]
        elif options.validate == "header":
            h, w = image_size(data)
        else:
            h, w = 0, 0  # unknown: not looked at
    except DecodeError as exc:
        return SourceError(rel, str(exc))
    except Exception as exc:  # a codec crash on hostile bytes must not abort the conversion
        return SourceError(rel, f"cannot decode image: {type(exc).__name__}: {exc}")
    return PreparedSample(-1, rel, label, data, h, w)


def read_source(path: Path) -> bytes:
    """The whole file, refusing special files (a FIFO would block forever) and files that change size."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read()
        if len(data) != st.st_size and st.st_size != 0:
            raise OSError(errno.EAGAIN, f"changed while being read ({st.st_size} bytes, then {len(data)})")
        return data
    finally:
        os.close(fd)


def _prepare_chunk(root: Path, items: list[tuple[str, int]], options: ConvertOptions) -> list:
    return [prepare(root, rel, label, options) for rel, label in items]


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
                with open(path, "rb") as fh:
                    h, w = image_size(fh.read(1 << 20))
                spec = options.resize_spec
                if spec is not None:
                    h, w = spec.output_shape(h, w)
                sizes.append(h * w * 3)
            else:
                sizes.append(path.stat().st_size)
        except (OSError, DecodeError):
            continue
    return float(np.mean(sizes)) if sizes else 1.0


def plan_shards(num_files: int, mean_bytes: float, shard_bytes: int | None) -> list[tuple[int, int]]:
    """Split source positions into (start, stop) runs of roughly ``shard_bytes`` each."""
    if shard_bytes is None:
        return [(0, num_files)]
    per_shard = max(1, int(shard_bytes // max(mean_bytes, 1.0)))
    return [(s, min(s + per_shard, num_files)) for s in range(0, num_files, per_shard)]


def check_free_space(directory: Path, needed: float) -> None:
    free = shutil.disk_usage(directory).free
    if needed * 1.05 > free:
        raise PackerError(
            f"{directory}: not enough free disk space: the output needs about {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB free (choose another --output, or --resize for raw payloads)"
        )


# ---------------------------------------------------------------- driver


def _ordered_results(
    root: Path, items: list[tuple[str, int]], options: ConvertOptions, workers: int
) -> Iterator[PreparedSample | SourceError]:
    """Prepared samples in source order; a bounded number of chunks in flight keeps memory flat."""
    chunks = [items[i : i + _CHUNK] for i in range(0, len(items), _CHUNK)]
    if workers <= 0:
        for chunk in chunks:
            yield from _prepare_chunk(root, chunk, options)
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        pending: deque[Future] = deque()
        todo = iter(chunks)
        try:
            for chunk in todo:
                pending.append(pool.submit(_prepare_chunk, root, chunk, options))
                if len(pending) >= workers * 4:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="img", disable=not enabled, dynamic_ncols=True, smoothing=0.1,
                desc="packing", file=sys.stderr)


def convert(
    src: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    to: str = "lmdb",
    payload: str | None = None,
    validate: Validate = "full",
    on_error: Literal["skip", "raise"] = "skip",
    workers: int | None = None,
    shard_bytes: int | None = None,
    resize: str | None = None,
    resize_mode: str = "stretch",
    upscale: bool = False,
    tile: str | None = None,
    grid: str | None = None,
    codec: str | None = None,
    quality: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> ConvertResult:
    """Pack the images of folder ``src`` into a dataset of format ``to``; see ``packer convert --help``.

    ``payload`` defaults to ``encoded`` where the format stores it, else ``raw`` (bmp, mosaic).
    """
    if payload is None:
        payload = "encoded" if "encoded" in get_format(to).PAYLOADS else "raw"
    options = ConvertOptions(format=to, payload=payload, validate=validate, shard_bytes=shard_bytes,
                             resize=None if resize is None else str(resize), resize_mode=resize_mode, upscale=upscale,
                             tile=None if tile is None else str(tile), grid=None if grid is None else str(grid),
                             codec=codec, quality=quality)
    options.check()
    if on_error not in ("skip", "raise"):
        raise PackerError(f"unknown error policy {on_error!r} (choose skip or raise)")
    fmt = get_format(to)
    if options.shard_bytes is None:
        options.shard_bytes = fmt.DEFAULT_SHARD_BYTES
    workers = os.cpu_count() or 1 if workers is None else workers

    started = time.perf_counter()
    scan = scan_folder(src)
    out = Path(output) if output is not None else default_output(scan.root, to)
    out = Path(os.path.abspath(out))
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    if out.exists() and not overwrite:
        raise PackerError(f"{out}: already exists (use --overwrite to replace it)")
    if partial.exists():
        raise PackerError(
            f"{partial}: left over from an interrupted conversion; remove it first (rm -r '{partial}')"
        )
    out.parent.mkdir(parents=True, exist_ok=True)

    mean_bytes = estimate_sample_bytes(scan, options)
    check_free_space(out.parent, mean_bytes * len(scan))
    plan = plan_shards(len(scan), mean_bytes, options.shard_bytes)

    partial.mkdir()
    try:
        result = _write_all(scan, partial, plan, fmt, options, on_error, workers, progress)
    except BaseException:
        if not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            shutil.rmtree(partial, ignore_errors=True)
        raise
    shards, meta_files, index, errors, bytes_read = result

    manifest = Manifest(
        format=to,
        payload=options.payload,
        num_samples=len(index),
        classes=list(scan.classes),
        shards=shards,
        meta_files=meta_files,
        options={k: v for k, v in asdict(options).items() if k != "decoder"},
        num_errors=len(errors),
        source=str(scan.root),
        created_by=f"packer {__version__}",
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    (partial / ERRORS_NAME).write_text(
        json.dumps({"num_errors": len(errors), "ignored": dict(scan.ignored), "errors": [asdict(e) for e in errors]},
                   indent=1, ensure_ascii=False),
        encoding="utf-8",
    )
    fsync_tree(partial)
    write_manifest(partial, manifest)
    _swap_into_place(partial, out)
    return ConvertResult(out, len(index), errors, time.perf_counter() - started, bytes_read, dict(scan.ignored))


def _write_all(scan, partial, plan, fmt, options, on_error, workers, progress):
    items = list(zip(scan.rel_paths, scan.labels.tolist()))
    shards: list[Shard] = []
    rel_paths: list[str] = []
    labels, heights, widths, nbytes = [], [], [], []
    errors: list[SourceError] = []
    bytes_read = 0
    results = _ordered_results(scan.root, items, options, workers)
    bar = _progress(len(items), progress)
    hasher = ThreadPoolExecutor(max_workers=1)
    try:
        for shard_id, (start, stop) in enumerate(plan):
            writer = fmt.Writer(partial, shard_id, stop - start, options.payload, asdict(options))
            count = 0
            try:
                for _ in range(start, stop):
                    res = next(results)
                    bar.update(1)
                    if isinstance(res, SourceError):
                        if on_error == "raise":
                            raise PackerError(f"{scan.root / res.path}: {res.reason}")
                        errors.append(res)
                        continue
                    res.index = len(rel_paths)
                    writer.add(res)
                    rel_paths.append(res.rel_path)
                    labels.append(res.label)
                    heights.append(res.height)
                    widths.append(res.width)
                    nbytes.append(res.nbytes)
                    bytes_read += res.nbytes
                    count += 1
                    if bar.n % 64 == 0:
                        bar.set_postfix_str(f"{bytes_read / 1e6 / max(bar.format_dict['elapsed'], 1e-9):.0f} MB/s")
                names, facts = writer.close()
            except BaseException:
                writer.abort()
                raise
            # Checksums of finished shards are computed in a thread while the next shard is written.
            shards.append(Shard(num_samples=count, files=[hasher.submit(file_info, partial, n) for n in names],
                                facts=facts))
        for shard in shards:
            shard.files = [f.result() for f in shard.files]
    finally:
        bar.close()
        results.close()
        hasher.shutdown(cancel_futures=True)
    index = Index.build(rel_paths, labels, heights, widths, nbytes)
    meta_names = index.save(partial)
    meta_files = [file_info(partial, n) for n in meta_names]
    if errors:
        print(f"packer: {len(errors)} of {len(items)} files not packed, see {ERRORS_NAME}:", file=sys.stderr)
        for e in errors[:10]:
            print(f"  {e.path}: {e.reason}", file=sys.stderr)
        if len(errors) > 10:
            print(f"  ... and {len(errors) - 10} more", file=sys.stderr)
    return shards, meta_files, index, errors, bytes_read


def _swap_into_place(partial: Path, out: Path) -> None:
    """Rename the finished output into place; an old output (--overwrite) is replaced only now.

    Readers that already opened the old dataset keep reading its (unlinked) files.
    """
    trash = out.with_name(out.name + ".old")
    if out.exists():
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(out, trash)
    os.replace(partial, out)
    shutil.rmtree(trash, ignore_errors=True)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Flush every file below ``directory`` and the directories themselves to disk."""
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
