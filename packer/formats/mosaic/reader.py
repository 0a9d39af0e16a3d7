"""Mosaic shards read: a tile cut from its mosaic by the strategy ``tile_read`` names (a region of a BMP's map,
a JPEG's restart intervals decoded alone, or the whole mosaic decoded and kept in a small per-process cache), each
mosaic file checked against the manifest's geometry before anything is decoded (layout: ``packer.formats.mosaic``).
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import DatasetError, OptionError, PackerError
from packer.formats.base import (
    Destinations,
    ShardReader,
    pread_exactly,
)
from packer.formats.filemap import check_size, closed_on_error, map_readonly, open_checked
from packer.formats.mosaic.geometry import (
    CODECS,
    JPEG_MCU,
    Geometry,
    expected_intervals,
)
from packer.images import bmp as bmpfile
from packer.images import jpegtiles
from packer.images.decode import decode, turbojpeg_handle
from packer.images.headers import image_size
from packer.layout.manifest import Shard
from packer.layout.trust import load_npy
from packer.lru import LRU
from packer.perprocess import PerProcess

# Decoded mosaics kept per reader and process (at least one), for the full-decode path only (png,
# or jpeg with tile_read="full"): ~8 default mosaics, the block sampler's default open blocks.
CACHE_BYTES = 160 << 20


def _geometry_from_facts(shard: Shard, where: Path) -> Geometry:
    f = shard.facts
    try:
        (th, tw), (rows, cols) = f["tile"], f["grid"]
        geom = Geometry(int(th), int(tw), int(rows), int(cols), str(f["codec"]), int(f["quality"]))
        counts = [int(c) for c in f["samples_per_mosaic"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: mosaic shard facts are malformed ({type(exc).__name__}: {exc})") from None
    if min(geom.tile_h, geom.tile_w, geom.rows, geom.cols) < 1 or geom.codec not in CODECS or (
            geom.codec == "jpeg" and (geom.tile_h % JPEG_MCU or geom.tile_w % JPEG_MCU)):
        raise DatasetError(f"{where}: mosaic shard facts are malformed ({f.get('tile')}, {f.get('grid')})")
    per_mosaic = 2 if geom.codec == "jpeg" else 1  # jpeg: mosaics, then their interval indexes
    if len(counts) * per_mosaic != len(shard.files) or sum(counts) != shard.num_samples or any(not 1 <= c <= geom.cells
                                                                                   for c in counts):
        raise DatasetError(f"{where}: mosaic counts {counts[:8]} do not match {len(shard.files)} files and "
                           f"{shard.num_samples} samples")
    return geom


MAPPED_MOSAICS = 16  # mosaic files a reader keeps mapped (and open, for the size checks) per process


@dataclass
class _Mapped:
    """One mosaic file as a reader keeps it open."""

    buf: mmap.mmap | bytes  # its map (b"" for an empty file)
    info: Any  # bmp: its parsed header; jpeg: its restart-interval index
    fd: int  # kept open for the size checks
    head: bytes  # jpeg: the bytes before the scan, read on opening


def _close_mapped(m: _Mapped) -> None:
    os.close(m.fd)  # the map is dropped, not closed: tiles handed out may still view it


@dataclass
class _Caches:
    """One process's caches of a mosaic reader."""

    cache_bytes: int = CACHE_BYTES
    decoded: LRU[int, np.ndarray] = field(init=False)  # mosaic -> decoded pixels, at least one
    maps: LRU[int, _Mapped] = field(default_factory=lambda: LRU(MAPPED_MOSAICS, drop=_close_mapped))

    def __post_init__(self) -> None:
        self.decoded = LRU(self.cache_bytes, weight=lambda a: a.nbytes)

    def close(self) -> None:
        self.maps.clear()
        self.decoded.clear()


class Reader(ShardReader):
    """Reads tiles of one shard's mosaics.

    ``tile_read``: ``region`` (bmp: read only the tile's bytes from a memory map), ``segments``
    (jpeg: copy the tile's restart intervals into a small JPEG and decode only that, see
    ``packer.images.jpegtiles``), ``full`` (decode the whole mosaic, keep it in a small per-process LRU
    cache, return the tile: cheap when neighbours follow, ruinous in uniform random order over
    more mosaics than the cache holds), ``crop`` (jpeg: libjpeg-turbo's lossless crop, which
    entropy-decodes the whole mosaic every time; falls back to ``full`` without libturbojpeg).
    ``auto``: region for bmp, full for png (its only path), segments for jpeg.
    """

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential",
                 tile_read: str = "auto", cache_bytes: int = CACHE_BYTES) -> None:
        self.directory = Path(directory)
        self.geom = _geometry_from_facts(shard, directory)
        self.counts = [int(c) for c in shard.facts["samples_per_mosaic"]]
        self.paths = [self.directory / f.name for f in shard.files[: len(self.counts)]]
        self.sizes = [f.num_bytes for f in shard.files[: len(self.counts)]]  # each mosaic's, per the manifest
        self.index_paths = [self.directory / f.name for f in shard.files[len(self.counts):]]
        self.starts = np.cumsum([0] + self.counts, dtype=np.int64)
        allowed = {"bmp": ("region",), "png": ("full",), "jpeg": ("segments", "full", "crop")}[self.geom.codec]
        if tile_read == "auto":  # the path that serves any order well; full decodes only pay off in block order
            tile_read = allowed[0]
        if tile_read not in allowed:
            raise OptionError(f"tile_read={tile_read!r} does not suit {self.geom.codec} mosaics ({', '.join(allowed)})")
        self.tile_read = tile_read
        self.cache_bytes = cache_bytes
        # a forked worker starts with empty caches
        self._state: PerProcess[_Caches] = PerProcess(partial(_Caches, cache_bytes), inherited=_Caches.close)

    @property
    def _cache(self) -> LRU[int, np.ndarray]:
        return self._state.get().decoded

    @property
    def _maps(self) -> LRU[int, _Mapped]:
        return self._state.get().maps

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, pos: int) -> tuple[int, int]:
        """(mosaic number, cell inside it) of position ``pos``."""
        if not 0 <= pos < len(self):
            raise DatasetError(f"{self.directory}: sample {pos} is not in this shard of {len(self)}")
        m = int(np.searchsorted(self.starts, pos, side="right")) - 1
        return m, pos - int(self.starts[m])

    def read(self, pos: int) -> np.ndarray:
        """Tile ``pos`` as a new HWC uint8 RGB array."""
        m, cell = self.locate(pos)
        g = self.geom
        top, left = g.origin(cell)
        if self.tile_read == "region":
            buf, header = self._mapped(m)
            return bmpfile.region(buf, header, top, left, g.tile_h, g.tile_w)
        if self.tile_read == "segments":
            buf, index = self._mapped(m)
            first = top // 8 * g.cols + left // g.tile_w
            data = jpegtiles.tile_jpeg(buf, index, first, g.tile_h // 8, g.cols, g.tile_h, g.tile_w, self.paths[m])
            return self._decode_tile(data, m, cell)
        if self.tile_read == "crop" and (turbo := turbojpeg_handle()) is not None:
            try:
                data = turbo.crop(self._read_file(m, checked=True), left, top, g.tile_w, g.tile_h)
            except OSError as exc:
                raise DatasetError(f"{self.paths[m]}: cannot cut tile {cell} out of the mosaic ({exc})") from exc
            return self._decode_tile(data, m, cell)
        return self._mosaic(m)[top : top + g.tile_h, left : left + g.tile_w].copy()

    def read_many(self, positions: list[int]) -> list[np.ndarray]:
        return [self.read(p) for p in positions]

    def read_copies(self, positions: list[int], buf: Destinations = None) -> list[np.ndarray]:
        """``read`` of each tile with its bytes read by ``pread``, never through the map (``ShardReader.read_copies``):
        bmp, the tile's row band; jpeg segments, its restart intervals behind the header read on opening. Whole
        mosaics (``full``, ``crop``) are read, not mapped, already."""
        if self.tile_read not in ("region", "segments"):
            return self.read_many(positions)
        return [self._tile_read(p) for p in positions]

    def _tile_read(self, pos: int) -> np.ndarray:
        m, cell = self.locate(pos)
        g = self.geom
        top, left = g.origin(cell)
        _buf, info = self._mapped(m)  # the file seen to have kept its size; its map is not touched
        fd, head = self._open(m).fd, self._open(m).head
        if self.tile_read == "region":
            first = top if info.top_down else info.height - top - g.tile_h
            band = np.empty(g.tile_h * info.stride, dtype=np.uint8)
            pread_exactly(fd, [band.data], info.offset + first * info.stride, self.paths[m], self.sizes[m])
            return bmpfile.region(band, replace(info, offset=0, height=g.tile_h), 0, left, g.tile_h, g.tile_w)
        first = top // 8 * g.cols + left // g.tile_w
        rows = [first + j * g.cols for j in range(g.tile_h // 8)]
        lo, hi = int(info[rows[0], 0]), int(info[rows[-1], 1])
        if lo < len(head) or hi < lo:
            raise PackerError(f"{self.paths[m]}: tile index puts tile {cell} inside the header")
        segments = np.empty(hi - lo, dtype=np.uint8)
        pread_exactly(fd, [segments.data], lo, self.paths[m], self.sizes[m])
        data = head + segments.tobytes()
        index = info - (lo - len(head))  # as offsets into ``data``
        return self._decode_tile(jpegtiles.tile_jpeg(data, index, first, g.tile_h // 8, g.cols, g.tile_h, g.tile_w,
                                                     self.paths[m]), m, cell)

    def file_spans(self, positions: list[int]) -> list[list[tuple[str, int, int]]]:
        """Per position, what reading its tile touches (see packer.read.readahead).

        bmp: the tile's row band; jpeg segments: the tile's restart intervals; otherwise (whole
        mosaics are decoded) the whole file, unless this process has it decoded already.
        """
        out: list[list[tuple[str, int, int]]] = []
        for pos in positions:
            m, cell = self.locate(pos)
            top, _left = self.geom.origin(cell)
            path = str(self.paths[m])
            if self.tile_read == "full" and m in self._cache:
                out.append([])
            elif self.tile_read == "region":
                _buf, info = self._map(m)
                first = top if info.top_down else info.height - top - self.geom.tile_h
                start = info.offset + first * info.stride
                out.append([(path, start, start + self.geom.tile_h * info.stride)])
            elif self.tile_read == "segments":
                _buf, index = self._map(m)
                band = top // 8 * self.geom.cols
                last = band + (self.geom.tile_h // 8 - 1) * self.geom.cols + self.geom.cols - 1
                out.append([(path, int(index[band, 0]), int(index[last, 1]))])
            else:
                out.append([(path, 0, self.paths[m].stat().st_size)])
        return out

    def _decode_tile(self, data: bytes, m: int, cell: int) -> np.ndarray:
        try:
            tile = decode(data, "auto", strict=True)
        except PackerError as exc:
            raise DatasetError(f"{self.paths[m]}: cannot decode tile {cell} of the mosaic ({exc})") from exc
        return self._checked(tile, (self.geom.tile_h, self.geom.tile_w, 3), m)

    def _read_file(self, m: int, checked: bool = False) -> bytes:
        """The mosaic file's bytes; ``checked``: its header agrees with the manifest (see ``_check_header``)."""
        try:
            with open(self.paths[m], "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise DatasetError(f"{self.paths[m]}: cannot read mosaic ({exc.strerror or exc})") from exc
        if checked:
            self._check_header(m, data)
        return data

    def _check_header(self, m: int, data) -> None:
        """The image header gives the mosaic size the manifest's geometry says: checked before decoding
        anything, so a crafted header can't make the decoder allocate more than the packed mosaic."""
        try:
            h, w = image_size(data)
        except PackerError as exc:
            raise DatasetError(f"{self.paths[m]}: cannot decode mosaic ({exc})") from exc
        want = self.geom.shape(self.counts[m])
        if (h, w) != want[:2]:
            raise DatasetError(f"{self.paths[m]}: image header says {h}x{w}, the manifest says {want[0]}x{want[1]}")

    def _checked(self, pixels: np.ndarray, shape: tuple, m: int) -> np.ndarray:
        if pixels.shape != shape:
            raise DatasetError(f"{self.paths[m]}: decoded to {pixels.shape}, the manifest says {shape}")
        return pixels

    def _mapped(self, m: int) -> tuple:
        """``_map(m)``, its file seen to have kept its size: touching a page past the end of a file
        truncated in place would kill the process (SIGBUS)."""
        buf, info = self._map(m)
        check_size(self._open(m).fd, self.sizes[m], self.paths[m])
        return buf, info

    def _map(self, m: int) -> tuple:
        """The mosaic's file mapped read-only, with its BMP header (bmp) or restart-interval index (jpeg)."""
        return self._open(m).buf, self._open(m).info

    def _open(self, m: int) -> _Mapped:
        """The mosaic's file as this process keeps it (among the last ``MAPPED_MOSAICS`` used), opened on first use."""
        kept = self._maps.get(m)
        if kept is not None:
            return kept
        path = self.paths[m]
        with closed_on_error(open_checked(path, self.sizes[m], "mosaic")) as fd:
            try:
                buf = map_readonly(path, fd, "sequential") if self.sizes[m] else b""
                # The header by a small read: a page fault on the map would read megabytes around it.
                head = os.pread(fd, bmpfile.HEADER_BYTES, 0) if self.geom.codec == "bmp" else b""
                shape = self.geom.shape(self.counts[m])
                if self.geom.codec == "bmp":
                    info = bmpfile.parse_header(head, self.sizes[m], path)
                    if (info.height, info.width, 3) != shape:
                        raise DatasetError(f"{path}: a {info.height}x{info.width} BMP, the manifest says {shape}")
                else:
                    info = self._load_index(m, self.sizes[m])
                    # the header up to the scan, by a read (kept for read_copies' tiles): never through the map
                    head = os.pread(fd, int(info[0, 0]) if len(info) else self.sizes[m], 0)
                    self._check_header(m, head)
            except OSError as exc:
                raise DatasetError(f"{path}: cannot read mosaic ({exc.strerror or exc})") from exc
        return self._maps.put(m, _Mapped(buf, info, fd, head))

    def _load_index(self, m: int, size: int) -> np.ndarray:
        path = self.index_paths[m]
        n = expected_intervals(self.geom, self.counts[m])
        index = load_npy(path, "<i8", ndim=2, max_items=2 * n)  # its header checked against the file first
        if index.shape != (n, 2) or (n and (
                index.min() < 0 or index.max() > size or np.any(index[:, 0] > index[:, 1]))):
            raise DatasetError(f"{path}: tile index does not describe {self.paths[m].name} "
                               f"({index.dtype} {index.shape}, expected <i8 ({n}, 2) within {size} bytes)")
        return index

    def _mosaic(self, m: int) -> np.ndarray:
        kept = self._cache.get(m)
        if kept is not None:
            return kept
        data = self._read_file(m, checked=True)
        try:
            pixels = decode(data, "auto", strict=True)
        except PackerError as exc:
            raise DatasetError(f"{self.paths[m]}: cannot decode mosaic ({exc})") from exc
        return self._cache.put(m, self._checked(pixels, self.geom.shape(self.counts[m]), m))

    def close(self) -> None:
        self._state.close(_Caches.close)
        super().close()
