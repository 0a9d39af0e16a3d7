"""Mosaic shards: images resized to one tile size and laid out row by row on a grid; each mosaic is one image file.

| file                              | holds                                                    |
|-----------------------------------|----------------------------------------------------------|
| mosaic-<shard>-<n>.bmp/.png/.jpg  | one mosaic: up to rows x cols tiles of tile_h x tile_w,  |
|                                   | sample k of the mosaic at row k // cols, column k % cols  |
| mosaic-<shard>-<n>.jpg.rst.npy    | jpeg only: <i8 [n, 2] byte ranges of its restart intervals |

Shard facts (manifest): ``tile`` [h, w], ``grid`` [rows, cols], ``codec``, ``quality`` and
``samples_per_mosaic`` (one count per mosaic; the shard's files list the mosaics in order, then
for jpeg their indexes): every mosaic is full except the last of a
shard, which is cut after its last used row (unused cells of that row are black). One mosaic
is one block of neighbouring samples for the block sampler (``block_boundaries``).

Codecs: ``bmp`` (default; lossless, uncompressed, one tile is read from a memory map without
touching the rest), ``png`` (lossless, smaller, but the whole mosaic is decoded for any tile:
kept in a small per-process cache, so read it in block order), ``jpeg`` (explicit, lossy, the
smallest; 4:4:4 with tiles on MCU boundaries and a restart marker per tile band, so one tile is
cut out by copying its bytes and decoded alone, identical to decoding the whole mosaic: see
``packer.images.jpegtiles``; each jpeg mosaic has its interval index beside it, ``<mosaic>.rst.npy``).
The default grid makes one mosaic about 16 MB decoded.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from packer.argtypes import int_in
from packer.errors import DatasetError, OptionError, PackerError, arg
from packer.formats.base import (
    Destinations,
    Format,
    Option,
    PreparedSample,
    ShardReader,
    ShardWriter,
    check_size,
    pread_exactly,
)
from packer.formats.mosaic_geometry import (
    CODECS,
    EXTENSIONS,
    INDEX_SUFFIX,
    JPEG_MCU,
    Geometry,
    block_boundaries,
    encode,
    error_bound,
    expected_intervals,
    geometry,
)
from packer.images import bmp as bmpfile
from packer.images import jpegtiles
from packer.images.decode import decode, turbojpeg_handle
from packer.images.headers import image_size
from packer.images.resize import ResizeSpec
from packer.layout.manifest import Manifest, Shard
from packer.layout.trust import load_npy
from packer.perprocess import PerProcess

# Decoded mosaics kept per reader and process (at least one), for the full-decode path only (png,
# or jpeg with tile_read="full"): ~8 default mosaics, the block sampler's default open blocks.
CACHE_BYTES = 160 << 20


class Writer(ShardWriter):
    """Fills one mosaic at a time; writes it when full, and the last one, cut after its last row, on close."""

    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> None:
        if payload != "raw":
            raise OptionError(f"the mosaic format stores decoded pixels: use {arg('payload', 'raw')}")
        self.directory = Path(directory)
        self.shard_id = shard_id
        self.geom = geometry(options)
        self._canvas: np.ndarray | None = None
        self._filled = 0
        self._counts: list[int] = []
        self._names: list[str] = []
        self._sidecars: list[str] = []  # jpeg: the restart-interval index of each mosaic

    def add(self, sample: PreparedSample) -> None:
        g = self.geom
        px = sample.payload
        if not isinstance(px, np.ndarray) or px.shape != (g.tile_h, g.tile_w, 3):
            shape = getattr(px, "shape", None)
            raise PackerError(f"{sample.rel_path}: a mosaic tile must be {g.tile_h}x{g.tile_w}x3, got {shape}")
        if self._canvas is None:
            self._canvas = np.zeros((g.rows * g.tile_h, g.cols * g.tile_w, 3), dtype=np.uint8)
        top, left = g.origin(self._filled)
        self._canvas[top : top + g.tile_h, left : left + g.tile_w] = px
        self._filled += 1
        if self._filled == g.cells:
            self._flush()

    def _flush(self) -> None:
        assert self._canvas is not None
        name = f"mosaic-{self.shard_id:05d}-{len(self._names):06d}.{EXTENSIONS[self.geom.codec]}"
        used = self.geom.shape(self._filled)[0]
        data = encode(np.ascontiguousarray(self._canvas[:used]), self.geom)
        with open(self.directory / name, "xb") as fh:
            fh.write(data)
        self._names.append(name)
        if self.geom.codec == "jpeg":
            index = jpegtiles.restart_index(data, name)
            if len(index) != expected_intervals(self.geom, self._filled):
                import PIL

                raise PackerError(f"{name}: the JPEG encoder wrote {len(index)} restart intervals, expected "
                                  f"{expected_intervals(self.geom, self._filled)}: jpeg mosaics need Pillow >= 10.2 "
                                  f"(restart markers), this is {PIL.__version__}")
            np.save(self.directory / (name + INDEX_SUFFIX), index, allow_pickle=False)
            self._sidecars.append(name + INDEX_SUFFIX)
        self._counts.append(self._filled)
        self._canvas[:] = 0
        self._filled = 0

    def close(self) -> tuple[list[str], dict]:
        if self._filled:
            self._flush()
        g = self.geom
        return self._names + self._sidecars, {"tile": [g.tile_h, g.tile_w], "grid": [g.rows, g.cols], "codec": g.codec,
                                   "quality": g.quality, "samples_per_mosaic": list(self._counts)}

    def abort(self) -> None:
        for name in self._names + self._sidecars:
            try:
                os.remove(self.directory / name)
            except OSError:
                pass


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


@dataclass
class _Caches:
    """One process's caches of a mosaic reader."""

    decoded: OrderedDict[int, np.ndarray] = field(default_factory=OrderedDict)  # mosaic -> decoded pixels
    # mosaic -> (mmap, header or index, file, jpeg: the bytes before the scan, read on opening)
    maps: OrderedDict[int, tuple] = field(default_factory=OrderedDict)

    def close(self) -> None:
        for entry in self.maps.values():
            entry[2].close()
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
        self._state: PerProcess[_Caches] = PerProcess(_Caches)  # a forked worker starts with empty caches

    @property
    def _cache(self) -> OrderedDict[int, np.ndarray]:
        return self._state.get().decoded

    @property
    def _maps(self) -> OrderedDict[int, tuple]:
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
        fd, head = self._maps[m][2].fileno(), self._maps[m][3]
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
        check_size(self._maps[m][2].fileno(), self.sizes[m], self.paths[m])
        return buf, info

    def _map(self, m: int) -> tuple:
        """The mosaic's file mapped read-only, with its BMP header (bmp) or restart-interval index (jpeg).

        The file stays open (for ``_mapped``'s size checks) while it is among the last 16 mapped.
        """
        if m in self._maps:
            self._maps.move_to_end(m)
            return self._maps[m][:2]
        path = self.paths[m]
        try:
            fh = open(path, "rb")
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read mosaic ({exc.strerror or exc})") from exc
        try:
            check_size(fh.fileno(), self.sizes[m], path)
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if self.sizes[m] else b""
            # The header by a small read: a page fault on the map would read megabytes around it.
            head = os.pread(fh.fileno(), bmpfile.HEADER_BYTES, 0) if self.geom.codec == "bmp" else b""
            shape = self.geom.shape(self.counts[m])
            if self.geom.codec == "bmp":
                info = bmpfile.parse_header(head, self.sizes[m], path)
                if (info.height, info.width, 3) != shape:
                    raise DatasetError(f"{path}: a {info.height}x{info.width} BMP, the manifest says {shape}")
            else:
                info = self._load_index(m, self.sizes[m])
                # the header up to the scan, by a read (kept for read_copies' tiles): never through the map
                head = os.pread(fh.fileno(), int(info[0, 0]) if len(info) else self.sizes[m], 0)
                self._check_header(m, head)
        except OSError as exc:
            fh.close()
            raise DatasetError(f"{path}: cannot read mosaic ({exc.strerror or exc})") from exc
        except BaseException:
            fh.close()
            raise
        self._maps[m] = (buf, info, fh, head)
        while len(self._maps) > 16:
            # The map is dropped, not closed (tiles handed out may still view it); its file is closed.
            self._maps.popitem(last=False)[1][2].close()
        return buf, info

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
        if m in self._cache:
            self._cache.move_to_end(m)
            return self._cache[m]
        data = self._read_file(m, checked=True)
        try:
            pixels = decode(data, "auto", strict=True)
        except PackerError as exc:
            raise DatasetError(f"{self.paths[m]}: cannot decode mosaic ({exc})") from exc
        self._cache[m] = self._checked(pixels, self.geom.shape(self.counts[m]), m)
        while len(self._cache) > 1 and sum(a.nbytes for a in self._cache.values()) > self.cache_bytes:
            self._cache.popitem(last=False)
        return pixels

    def close(self) -> None:
        self._state.close(_Caches.close)
        super().close()


class MosaicFormat(Format):
    """Mosaic's hooks: its layout options are checked up front, shards hold whole mosaics, jpeg is lossy."""

    def check_options(self, options: Mapping) -> None:
        tile, resize = options.get("tile"), options.get("resize")
        geometry(options)  # --tile and --grid, named as given
        tile_spec, resize_spec = ResizeSpec.parse(tile, option="tile"), ResizeSpec.parse(resize)
        if tile_spec is not None and resize_spec is not None and tile_spec.fixed_shape != resize_spec.fixed_shape:
            raise OptionError(f"{arg('tile', tile)} already sets the size; drop {arg('resize', resize)}")

    def implied_resize(self, options: Mapping) -> str | None:
        return options.get("tile")

    def shard_multiple(self, options: Mapping) -> int:
        """Tiles per mosaic: shards of whole mosaics, so only a shard's last one is partly filled."""
        return geometry(options).cells

    def error_bound(self, options: Mapping) -> tuple[float, int]:
        return error_bound(options)

    def block_boundaries(self, manifest: Manifest) -> np.ndarray:
        return block_boundaries(manifest)


FORMAT = MosaicFormat(
    name="mosaic", dataset_class="MosaicDataset", payloads=frozenset({"raw"}), Writer=Writer, Reader=Reader,
    default_shard_bytes=1 << 30,  # resume granularity of a long conversion; shards hold whole mosaics
    options=(
        Option("tile", "mosaic: the size every image is resized to (stretched, or letterboxed with "
               "--resize-mode fit); required for --to mosaic", metavar="HxW"),
        Option("grid", "mosaic: tiles per mosaic, rows x columns (default: about 16 MB decoded per mosaic, "
               "e.g. 11x10 for 224x224 tiles)", metavar="RxC"),
        Option("codec", "mosaic file codec: bmp (default; lossless, a tile is read without decoding the rest), "
               "png (lossless, smaller, whole mosaics decoded), jpeg (lossy, smallest; tiles multiples of 16 px)",
               choices=CODECS),
        Option("quality", "mosaic jpeg quality 1-100 (default 95)", type=int_in(1, 100)),
    ),
)
