"""Shards, from source files to shard files: ``prepare`` (in worker processes) and ``write_shard`` (in order),
and ``BuildJob``, what every backend that builds the shards of a conversion is given.

Two backends build shards behind one ``build_shards(job)``: ``write.pool.LocalPool`` (a process pool
here prepares, this process writes) and ``write.cluster.DaskCluster`` (one Dask task per shard).
Both give the same bytes: a shard depends only on its planned sources and the options.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from packer.errors import PackerError
from packer.formats.base import Format, PreparedSample
from packer.images.decode import DecodeError, check_pixels, decode
from packer.images.headers import image_size
from packer.layout.manifest import Shard
from packer.layout.trust import open_regular
from packer.write.journal import ShardResult
from packer.write.options import ConvertOptions
from packer.write.scan import ScanResult, SourceError


@dataclass
class BuildJob:
    """What building a conversion's shards needs, whichever backend builds them."""

    scan: ScanResult  # in dataset order (write.plan.apply_order)
    partial: Path  # <out>.partial: the shards are written (and journaled) here
    ranges: list[tuple[int, int]]  # the plan: shard i holds scan positions ranges[i][0] .. ranges[i][1] - 1
    done: dict[int, ShardResult]  # shards a resumed run reuses (write.journal.load_done_shards)
    options: ConvertOptions
    on_error: str  # "skip" or "raise"
    progress: bool
    mean_bytes: float = 0.0  # the plan's estimate of a payload's size (sizes the local pool's buffers)

    def todo(self) -> list[int]:
        """The shards still to build, in order."""
        return [sid for sid in range(len(self.ranges)) if sid not in self.done]

    def done_samples(self) -> int:
        """The source files the reused shards cover (where a progress bar starts)."""
        return sum(b - a for sid, (a, b) in enumerate(self.ranges) if sid in self.done)


class ShardBuilder(Protocol):
    """A backend: builds every shard of ``job`` not done yet; returns every shard's result, done ones included."""

    def build_shards(self, job: BuildJob) -> dict[int, ShardResult]: ...


def progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="img", disable=not enabled, dynamic_ncols=True, smoothing=0.1,
                desc="packing", file=sys.stderr)


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
