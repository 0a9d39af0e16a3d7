"""At the end of a conversion: each sample's payload range and CRC-32 (``packer.layout.ranges``), where the format
stores payloads as plain byte ranges, so a URL of the dataset can be read in ranged mode (docs/remote.md).

Format-agnostic: each shard is opened with its format's own reader, and a sample's range is the last span its
``file_spans`` gives (the sample's own bytes, maybe with a record's header), taken only where the file's bytes
there are exactly the payload ``read_many`` returns: lmdb (values in overflow pages are contiguous too), memmap,
recordio, hdf5 and n5 uncompressed, pth, safetensors. A format whose payload is no plain range of one file records
nothing, and its URLs are read in whole-shard mode: bmp (a file per sample, rows padded and bottom-up), mosaic
(a sample is a tile of a larger image), hdf5 or n5 compressed (the stored bytes are inflated).
"""

from __future__ import annotations

import logging
import mmap
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from packer.formats import get_format
from packer.formats.filemap import map_readonly, open_checked
from packer.layout.index import Index
from packer.layout.manifest import Manifest, Shard
from packer.layout.ranges import DTYPES, RANGE_FILES, PayloadRanges

log = logging.getLogger(__name__)
STEP = 256  # samples asked of a reader at once


def payload_bytes(payload: object) -> memoryview:
    """A payload as flat bytes (encoded bytes, a buffer of them, or a raw HWC array)."""
    if isinstance(payload, np.ndarray):
        return np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data
    return memoryview(payload).cast("B")  # type: ignore[arg-type]


def record_ranges(folder: Path, manifest: Manifest, index: Index,
                  recorded: Callable[[Shard], PayloadRanges | None] | None = None) -> PayloadRanges | None:
    """The payload ranges of the dataset written in ``folder`` (its shards finished, ``manifest.shards`` and
    ``index`` filled in), or None where some sample's payload is not a plain byte range of a shard file. A shard
    whose files are no longer there (uploaded to a bucket and deleted from the staging folder) takes the ranges
    ``recorded`` kept for it while they were (``shard_ranges``); None where it kept none."""
    if manifest.payload not in ("encoded", "raw") or not manifest.num_samples:
        return None
    parts: list[PayloadRanges] = []
    at = 0
    for shard in manifest.shards:
        nbytes = index.nbytes[at:at + shard.num_samples]
        if all((folder / f.name).is_file() for f in shard.files):
            got = shard_ranges(folder, shard, manifest.format, manifest.payload, nbytes)
        else:
            got = None if recorded is None else recorded(shard)
        if got is None or len(got.file) != shard.num_samples:
            return None
        parts.append(got)
        at += shard.num_samples
    return PayloadRanges(*(np.concatenate([getattr(p, key) for p in parts]).astype(DTYPES[key])
                           for key in RANGE_FILES))


def shard_ranges(folder: Path, shard: Shard, fmt_name: str, payload: str, nbytes: np.ndarray) -> PayloadRanges | None:
    """The payload ranges of one finished shard in ``folder`` (``nbytes``: its samples' payload sizes), or None
    where some payload is not a plain byte range of one of its files (or the payload is neither encoded nor raw)."""
    if payload not in ("encoded", "raw"):
        return None
    n = shard.num_samples
    files = np.zeros(n, dtype=DTYPES["file"])
    offsets = np.zeros(n, dtype=DTYPES["offset"])
    crcs = np.zeros(n, dtype=DTYPES["crc32"])
    reader = get_format(fmt_name).Reader(folder, shard, payload, access="sequential")
    maps: dict[str, tuple[int, mmap.mmap | None]] = {}
    try:
        names = {os.path.realpath(folder / f.name): j for j, f in enumerate(shard.files)}
        for lo in range(0, n, STEP):
            positions = list(range(lo, min(lo + STEP, n)))
            for p, spans, data in zip(positions, reader.file_spans(positions), reader.read_many(positions),
                                      strict=True):
                data = payload_bytes(data)
                got = _locate(spans, data, names, maps) if len(data) == int(nbytes[p]) else None
                if got is None:
                    log.debug("%s: sample %d of a shard is no plain byte range: no ranged reads", folder, p)
                    return None
                files[p], offsets[p], crcs[p] = got
    finally:
        for _j, mm in maps.values():
            if mm is not None:
                mm.close()
        reader.close()
    return PayloadRanges(files, offsets, crcs)


def _locate(spans: list, data: memoryview, names: dict[str, int],
            maps: dict[str, tuple[int, mmap.mmap | None]]) -> tuple[int, int, int] | None:
    """(file number, offset, crc32) of a payload whose bytes lie in the last span ``file_spans`` gave for it (at
    its end, its start, or after a record's header); None where they are not there."""
    if not spans:
        return None
    path, start, end = spans[-1]
    if path not in maps:  # by the name the reader gives: resolved once a file, not once a sample (4 lstat calls)
        key = os.path.realpath(path)
        j = names.get(key)
        if j is None:
            return None
        fd = open_checked(key, what="shard file")
        try:
            maps[path] = (j, map_readonly(key, fd, "sequential") if os.fstat(fd).st_size else None)
        finally:
            os.close(fd)  # the map keeps its own duplicate
    j, mm = maps[path]
    size, nbytes = (0 if mm is None else len(mm)), len(data)
    if mm is None:
        return None
    end = min(end, size)
    for offset in (end - nbytes, start, mm.find(data[:64], start, end) if nbytes else -1):
        if start <= offset and offset + nbytes <= end and mm[offset:offset + nbytes] == data:
            return j, offset, zlib.crc32(data) & 0xFFFFFFFF
    return None
