"""How one dataset's payloads become pixels: its decoder, ``decode_size`` and fused crop, with every header checked.

Encoded headers are checked against the index before any decoder allocates (``check_header``), a codec's failure
on damaged bytes is a DecodeError naming the sample, and a chunk of JPEGs with batch slots is decoded by one call of
the compiled extension (``pixels_many``), whole or as fused crops; what it leaves goes one by one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from packer.errors import DatasetError, OptionError
from packer.images.crop import CropDecode, Window, check_crop, spread
from packer.images.decode import BACKENDS, DecodeError, check_min_size, copy_into, decode, decode_many, jpeg_frame
from packer.images.headers import check_size, image_size
from packer.images.magic import is_jpeg
from packer.layout.index import Index
from packer.layout.trust import DATA_ERRORS
from packer.read.indexing import IndexMap


class Decoding:
    """The decode settings of a dataset (``open_dataset``'s ``decoder``, ``decode_size``, ``crop``) over its index.
    Methods take storage positions; ``kind`` is what a payload holds: ``"encoded"`` bytes or ``"raw"`` pixels."""

    def __init__(self, index: Index, index_map: IndexMap, root: str, decoder: str = "auto",
                 decode_size: int | None = None, crop: CropDecode | None = None) -> None:
        if decoder not in BACKENDS:
            raise OptionError(f"unknown decoder {decoder!r} (choose from {', '.join(BACKENDS)})")
        self.index, self.index_map, self.root = index, index_map, root
        self.decoder = decoder
        self.decode_size = check_min_size(decode_size)
        self.crop = check_crop(crop, self.decode_size)

    def pixels(self, pos: int, payload, kind: str, strict: bool = False, out: np.ndarray | None = None,
               window: Window | None = None) -> np.ndarray:
        """The sample at ``pos`` as HWC uint8 RGB, into ``out`` where it has that size (``strict``: a decoder warning,
        e.g. a truncated JPEG, is an error too); a fused crop's through ``window``, else one drawn now."""
        h, w = int(self.index.heights[pos]), int(self.index.widths[pos])
        if kind == "encoded":
            self.check_header(pos, payload)
            with self._sample_errors(pos):
                if self.crop is not None:  # its random crop is drawn per (seed, epoch, ImageFolder index)
                    hh, ww = image_size(payload)
                    return self.crop.from_bytes(payload, self.index_map.public(pos), hh, ww, self.decoder, strict,
                                                out, window)
                return decode(payload, self.decoder, strict=strict, min_size=self.decode_size, out=out)
        arr = payload if isinstance(payload, np.ndarray) else np.frombuffer(payload, dtype=np.uint8)
        if arr.size != h * w * 3:
            raise DatasetError(f"{self.root}: sample {self.index_map.public(pos)} holds {arr.size} bytes, "
                               f"expected {h}x{w}x3")
        if self.crop is not None:
            return self.crop.from_pixels(arr.reshape(h, w, 3), self.index_map.public(pos), out, window)
        return copy_into(arr.reshape(h, w, 3), out)

    def pixels_many(self, positions: Sequence[int] | np.ndarray, payloads: Sequence, kind: str,
                    outs: Sequence[np.ndarray] | None = None, windows: Sequence[Window] | None = None
                    ) -> list[np.ndarray]:
        """``pixels`` of each (``outs``/``windows`` per sample); JPEGs with an out each decoded in one call."""
        pos = np.asarray(positions, dtype=np.int64)
        if outs is None and windows is None:  # each its own array, a crop drawn now where there is one
            return [self.pixels(p, b, kind) for p, b in zip(pos.tolist(), payloads, strict=True)]
        done = self._in_bulk(pos, payloads, outs, windows) if kind == "encoded" and outs is not None else None
        return [outs[k] if done is not None and done[k] == 1 else  # type: ignore[index]
                self.pixels(p, payloads[k], kind, out=None if outs is None else outs[k],
                            window=None if windows is None else windows[k])
                for k, p in enumerate(pos.tolist())]

    def _in_bulk(self, pos: np.ndarray, payloads: Sequence, outs: Sequence[np.ndarray],
                 windows: Sequence[Window] | None) -> bytes | None:
        """Per sample, 1 where the compiled extension decoded it into its out, whole (``decode_many``) or as a fused
        crop through its window (``from_bytes_many``). A header not a 3- or 1-component JPEG's of the index's size
        is not even tried (the one-by-one path says what is wrong), nor is a sample the extension leaves (CMYK,
        damage). None: no bulk path here (``decode_size``, Pillow as a crop's decoder, a crop without windows)."""
        if self.decode_size:
            return None
        heights, widths = self.index.heights[pos].tolist(), self.index.widths[pos].tolist()
        checked = [_plain_jpeg(data, h, w) for data, h, w in zip(payloads, heights, widths, strict=True)]
        if self.crop is None:
            ready = [k for k, ok in enumerate(checked) if ok]
            status = decode_many([payloads[k] for k in ready], [outs[k] for k in ready], self.decoder, strict=False)
            return None if status is None else spread(status, ready, len(pos))
        if windows is None or self.decoder == "pil":
            return None
        return self.crop.from_bytes_many(payloads, windows, heights, widths, outs, checked, strict=False)

    def check_header(self, pos: int, buf) -> None:
        """Refuse the encoded bytes at ``pos`` when their header's size is not the index's or is above the pixel
        limit: checked before any decoder (packer's, or DALI's in ``packer.dali``) allocates."""
        with self._sample_errors(pos):
            check_size(buf, int(self.index.heights[pos]), int(self.index.widths[pos]))

    def external(self, pos: int, payload, kind: str) -> np.ndarray:
        """The payload at ``pos`` as an external decoder (DALI) takes it: raw pixels as an HWC array, encoded bytes
        (header checked first) as a flat uint8 array."""
        if kind != "encoded":
            return self.pixels(pos, payload, kind)
        self.check_header(pos, payload)
        return np.frombuffer(payload, dtype=np.uint8)

    def windows(self, positions: Sequence[int] | np.ndarray) -> list[Window] | None:
        """The fused crop's window of each sample at these positions, drawn now in this order from the index's
        sizes: a batch's crops in its order, as a DataLoader's per-sample draws are, whichever sample's bytes come
        in first. None: no crop, or sizes the index lacks (each sample then draws from its header's size)."""
        if self.crop is None or not len(positions):
            return None
        pos = np.asarray(positions, dtype=np.int64)
        heights, widths = self.index.heights[pos], self.index.widths[pos]
        if heights.min() < 1 or widths.min() < 1:
            return None
        return self.crop.windows(heights.tolist(), widths.tolist(), self.index_map.public_many(pos).tolist())

    @contextmanager
    def _sample_errors(self, pos: int) -> Iterator[None]:
        """Any failure of a codec on the (damaged) bytes stored at ``pos`` as a DecodeError naming the sample."""
        try:
            yield
        except DecodeError as exc:
            raise DecodeError(f"{self.root}: sample {self.index_map.public(pos)} ({self.index.rel_path(pos)}): "
                              f"{exc}") from exc
        except DATA_ERRORS as exc:
            raise DecodeError(f"{self.root}: sample {self.index_map.public(pos)} ({self.index.rel_path(pos)}): "
                              f"cannot decode ({type(exc).__name__}: {exc})") from exc


def _plain_jpeg(data, height: int, width: int) -> bool:
    """Whether ``data`` is a JPEG whose frame header says ``height`` x ``width`` (> 0) in 3 or 1 components."""
    if height < 1 or width < 1 or not is_jpeg(data):
        return False
    try:
        return jpeg_frame(data) in ((height, width, 3), (height, width, 1))
    except DecodeError:
        return False
