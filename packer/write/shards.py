"""Shards, from source files to shard files: ``prepare`` (in worker processes) and ``write_shard`` (in order),
and ``BuildJob``, what every backend that builds the shards of a conversion is given.

Two backends build shards behind one ``build_shards(job)``: ``write.pool.LocalPool`` (a process pool
here prepares, this process writes) and ``write.cluster.DaskCluster`` (one Dask task per shard).
Both give the same bytes: a shard depends only on its planned sources and the options.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from packer.errors import PackerError
from packer.formats.base import Format, PreparedSample
from packer.images.decode import DecodeError, check_pixels, decode
from packer.images.headers import image_size
from packer.images.jpegregion import restart_transcode
from packer.images.magic import sniff
from packer.layout.manifest import IMAGELESS, FileInfo, Shard
from packer.progress import bar
from packer.write.journal import ShardResult
from packer.write.options import ConvertOptions
from packer.write.output import Output
from packer.write.sources.base import RecordError, SourceReader, read_source
from packer.write.sources.records import ScanResult, SourceError

__all__ = ["BuildJob", "ShardBuilder", "ShardSink", "ShardWriteError", "make_payload", "prepare", "read_source",
           "write_shard"]


@dataclass
class BuildJob:
    """What building a conversion's shards needs, whichever backend builds them."""

    scan: ScanResult  # in dataset order (write.plan.apply_order)
    output: Output  # the shards are written (and journaled) in its folder, <out>.partial
    ranges: list[tuple[int, int]]  # the plan: shard i holds scan positions ranges[i][0] .. ranges[i][1] - 1
    done: dict[int, ShardResult]  # shards a resumed run reuses (write.journal.load_done_shards)
    options: ConvertOptions
    on_error: str  # "skip" or "raise"
    progress: bool
    mean_bytes: float = 0.0  # the plan's estimate of a payload's size (sizes the local pool's buffers)

    @property
    def partial(self) -> Path:
        """The folder the shards are written in."""
        return self.output.folder

    def todo(self) -> list[int]:
        """The shards still to build, in order."""
        return [sid for sid in range(len(self.ranges)) if sid not in self.done]

    def done_samples(self) -> int:
        """The source files the reused shards cover (where a progress bar starts)."""
        return sum(b - a for sid, (a, b) in enumerate(self.ranges) if sid in self.done)


class ShardBuilder(Protocol):
    """A backend: builds every shard of ``job`` not done yet; returns every shard's result, done ones included."""

    def build_shards(self, job: BuildJob) -> dict[int, ShardResult]: ...


def progress_bar(total: int, progress: bool | None):
    """The bar of a conversion's files (packer.progress decides whether it is drawn)."""
    return bar(total=total, desc="packing", progress=progress, smoothing=0.1)


def prepare(reader: SourceReader, rel: str, label: int, options: ConvertOptions,
            loc: Any = None) -> PreparedSample | SourceError:
    """Read one record (``reader.read(rel, loc)``) and make its payload; a problem is a SourceError, no exception."""
    try:
        data, source_stat = reader.read(rel, loc)
    except RecordError as exc:
        return SourceError(rel, str(exc))
    return make_payload(rel, label, data, source_stat, options)


def make_payload(rel: str, label: int, data: bytes | np.ndarray, source_stat: list[int] | None,
                 options: ConvertOptions) -> PreparedSample | SourceError:
    """The payload of one record's bytes (validated per ``options.validate``, decoded for raw payloads) or
    pixels (an HWC uint8 array: raw payloads only); a problem is a SourceError, no exception."""
    if options.payload == IMAGELESS:  # a packed dataset of samples without an image (convert checked the source)
        return PreparedSample(-1, rel, label, b"", 0, 0, source_stat)
    if isinstance(data, np.ndarray):  # pixels from a packed source of raw payloads: nothing to decode
        return _from_pixels(rel, label, data, source_stat, options)
    if not data:
        return SourceError(rel, "empty file (0 bytes)")
    try:
        if options.payload == "raw":
            return _from_pixels(rel, label, decode(data, options.decoder, strict=True), source_stat, options)
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
    stored = stored_bytes(data, options)
    return PreparedSample(-1, rel, label, stored, h, w, source_stat, rewritten=stored != data)


def stored_bytes(data: bytes, options: ConvertOptions) -> bytes:
    """The encoded payload of a record's bytes: the bytes themselves, or with ``jpeg_restarts`` a JPEG rewritten
    with a restart marker per MCU (the same pixels; what can't be rewritten is kept as it is)."""
    if options.jpeg_restarts and sniff(data) == "jpeg":
        return restart_transcode(data) or data
    return data


def _from_pixels(rel: str, label: int, pixels: np.ndarray, source_stat: list[int] | None,
                 options: ConvertOptions) -> PreparedSample | SourceError:
    """A raw payload from decoded pixels, resized when asked. Pixels above the pixel limit are refused before
    anything is copied (a zero-stride view of 3 bytes may stand for gigabytes)."""
    if options.payload != "raw":
        return SourceError(rel, "the source holds decoded pixels: only --payload raw can store them (never re-encoded)")
    try:
        check_pixels(pixels.shape[0], pixels.shape[1], "image array is")
    except DecodeError as exc:
        return SourceError(rel, str(exc))
    spec = options.resize_spec
    if spec is not None:
        pixels = spec.apply(pixels)
    h, w = pixels.shape[:2]
    return PreparedSample(-1, rel, label, np.ascontiguousarray(pixels), h, w, source_stat)


class ShardWriteError(PackerError):
    """Writing a shard failed (disk full, I/O error): the conversion can be resumed."""


class ShardSink:
    """One shard being written: ``add`` each prepared sample (or the error of one that failed) in order, then
    ``close``; ``abort`` on failure. ``planned``: the samples offered to it (the format may size by it)."""

    def __init__(self, partial: Path, shard_id: int, planned: int, fmt: Format, options: ConvertOptions,
                 on_error: str, root: Path) -> None:
        self.partial, self.shard_id, self.on_error, self.root = partial, shard_id, on_error, root
        self.result = ShardResult(shard_id, Shard(num_samples=0, files=[]))
        try:
            self.writer = fmt.Writer(partial, shard_id, planned, options.payload, options.record())
        except PackerError:
            raise
        except Exception as exc:  # ENOSPC, EIO, the storage engine's own errors (lmdb.DiskError is no OSError)
            raise ShardWriteError(f"cannot create shard {shard_id} ({exc})") from exc

    def add(self, res: PreparedSample | SourceError) -> None:
        result = self.result
        if isinstance(res, SourceError):
            if self.on_error == "raise":
                raise PackerError(f"{self.root / res.path}: {res.reason}")
            result.errors.append(res)
            return
        res.index = len(result.rel_paths)  # position inside the shard
        try:
            self.writer.add(res)
        except PackerError:
            raise
        except Exception as exc:  # ENOSPC, EIO, the storage engine's own errors
            raise ShardWriteError(_write_failure(self.partial, self.shard_id, exc)) from exc
        result.rel_paths.append(res.rel_path)
        result.labels.append(res.label)
        result.heights.append(res.height)
        result.widths.append(res.width)
        result.nbytes.append(res.nbytes)
        result.stats.append(res.source_stat)
        result.rewritten += res.rewritten

    def close(self) -> tuple[ShardResult, list[str]]:
        """Finish the shard's files: its metadata and file names."""
        try:
            names, facts = self.writer.close()
        except PackerError:
            raise
        except Exception as exc:
            raise ShardWriteError(_write_failure(self.partial, self.shard_id, exc)) from exc
        self.result.shard.num_samples = len(self.result.rel_paths)
        self.result.shard.facts = facts
        # checksums the writer took while writing: the journal reads back only the other files
        self.result.shard.files = [FileInfo(n, (self.partial / n).stat().st_size, s)
                                   for n, s in self.writer.digests().items()]
        return self.result, names

    def abort(self) -> None:
        self.writer.abort()


def write_shard(
    partial: Path, shard_id: int, planned: int, samples: Iterable[PreparedSample | SourceError],
    fmt: Format, options: ConvertOptions, on_error: str, root: Path,
    on_each: Callable[[PreparedSample | SourceError], None] | None = None,
) -> tuple[ShardResult, list[str]]:
    """Write one shard from its prepared samples (in order); returns its metadata and file names."""
    sink = ShardSink(partial, shard_id, planned, fmt, options, on_error, root)
    try:
        for res in samples:
            if on_each is not None:
                on_each(res)
            sink.add(res)
        return sink.close()
    except BaseException:
        sink.abort()
        raise


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
