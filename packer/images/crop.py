"""Fused decode + crop + resize (+ flip): training's RandomResizedCrop and eval's resize + center crop in one
step that decodes a JPEG at the smallest DCT scale (1/2, 1/4, 1/8) still leaving the crop >= the output size.

A ``CropDecode`` turns an image size (from the header or the index, no pixels needed) into a ``Window``:
the source rectangle, in full-resolution pixels, and whether to flip it. ``decode_window`` then decodes
at the scale the window allows, resizes the window with antialiased bilinear (``resize_window``) and flips
it, into ``out`` where given. Semantics and the pixel bounds: docs/decoding.md.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from packer._random import raw_draws
from packer.errors import OptionError
from packer.images.decode import SCALE_DENOMINATORS, check_pixels, decode, pixel_limit, writable_as
from packer.images.jpegregion import decode_region, decode_regions, notice_missing, region_decode_available
from packer.images.magic import sniff
from packer.perprocess import PerProcess

ATTEMPTS = 10  # torchvision's RandomResizedCrop.get_params tries 10 crops, then falls back to a central one
DRAWS = 2 * ATTEMPTS + 3  # two per attempt, the crop's position (two), the flip (one)


@dataclass(frozen=True)
class Window:
    """A source rectangle in full-resolution pixels (fractional for resize-then-crop), and a horizontal flip."""

    top: float
    left: float
    height: float
    width: float
    flip: bool = False


def _size_pair(size: int | tuple[int, int]) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, (int, np.integer)) else tuple(size)
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1 for v in pair):
        raise OptionError(f"crop size {size!r}: expected a positive int or (height, width)")
    check_pixels(int(pair[0]), int(pair[1]), what="crop output")
    return int(pair[0]), int(pair[1])


class CropDecode(ABC):
    """How a dataset turns each image into a fixed-size output: ``window`` per sample, ``size`` for all."""

    size: tuple[int, int]  # (height, width) of every output
    region: bool = True  # decode only the window's region where the compiled decoder is built; False: whole

    @abstractmethod
    def window(self, height: int, width: int, index: int) -> Window:
        """The source rectangle for sample ``index`` of this full-resolution size."""

    def windows(self, heights: Sequence[int], widths: Sequence[int], indices: Sequence[int]) -> list[Window]:
        """``window`` for each sample, in order."""
        return [self.window(h, w, i) for h, w, i in zip(heights, widths, indices, strict=True)]

    def position(self) -> object | None:
        """Where this process's stream of random draws stands (None: the windows draw from no stream)."""
        return None

    def rewind(self, position: object) -> None:
        """The stream back at ``position``: the windows drawn since are drawn again (a loader that drew them for
        batches it never handed out gives them back, as a worker-less DataLoader never drew them)."""

    def from_bytes(self, data: bytes | memoryview, index: int, height: int, width: int, backend: str = "auto",
               strict: bool = True, out: np.ndarray | None = None, window: Window | None = None) -> np.ndarray:
        """Sample ``index``'s encoded bytes (``height`` x ``width`` per their header) as its output: through
        ``window`` where given (drawn with the batch, ``windows``), else the one ``window`` draws now."""
        if window is None:
            window = self.window(height, width, index)
        return decode_window(data, window, self.size, height, width, backend, strict, out, self.region)

    def from_bytes_many(self, datas: Sequence[bytes | memoryview], windows: Sequence[Window], heights: Sequence[int],
                        widths: Sequence[int], outs: Sequence[np.ndarray], checked: Sequence[bool],
                        strict: bool = True) -> bytes | None:
        """``from_bytes`` for many samples through their ``windows`` into ``outs``: the JPEGs whose headers the
        caller ``checked`` to say ``heights`` x ``widths`` (1 or 3 components) decoded by ``decode_windows``. Per
        item 1 where done; do the others one by one with ``from_bytes`` and the same window. None: no bulk path
        (the region decoder not built, or ``region=False``)."""
        if not self.region:
            return None
        tried = [k for k, ok in enumerate(checked) if ok]
        status = decode_windows([datas[k] for k in tried], [windows[k] for k in tried], self.size,
                                [heights[k] for k in tried], [widths[k] for k in tried], [outs[k] for k in tried],
                                strict)
        return None if status is None else spread(status, tried, len(windows))

    def from_pixels(self, pixels: np.ndarray, index: int, out: np.ndarray | None = None,
                    window: Window | None = None) -> np.ndarray:
        """Sample ``index``'s full-resolution HWC uint8 pixels (a raw payload) as its output (``window``: as
        ``from_bytes``'s)."""
        if window is None:
            window = self.window(pixels.shape[0], pixels.shape[1], index)
        return resize_window(pixels, window, self.size, out=out)


def check_crop(crop: CropDecode | None, decode_size: int | None) -> CropDecode | None:
    """A dataset's ``crop`` argument, checked: a CropDecode, and no ``decode_size`` beside it (it picks the scale)."""
    if crop is not None and (decode_size or not isinstance(crop, CropDecode)):
        raise OptionError(f"crop={crop!r}: expected a packer CropDecode, and no decode_size (the crop picks the scale)")
    return crop


def crop_params(height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
                u: np.ndarray) -> tuple[int, int, int, int]:
    """(top, left, h, w) by torchvision's ``RandomResizedCrop.get_params``, with ``u`` (>= 22 uniforms in
    [0, 1)) in place of torch's generator: 10 tries of area and log-ratio, then the central fallback."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for k in range(ATTEMPTS):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * float(u[2 * k]))
        aspect = math.exp(log_lo + (log_hi - log_lo) * float(u[2 * k + 1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(float(u[2 * ATTEMPTS]) * (height - h + 1))  # torch.randint(0, height - h + 1)
            left = int(float(u[2 * ATTEMPTS + 1]) * (width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _uniforms(raw: np.ndarray) -> np.ndarray:
    """Doubles in [0, 1) from raw uint64 draws (the top 53 bits, as numpy's ``random()`` makes them)."""
    return (raw >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _torch_seeded() -> np.random.PCG64:
    """This process's stream, seeded by torch (a DataLoader worker's seed differs per worker and epoch)."""
    return np.random.PCG64(torch.initial_seed())


class RandomResizedCropDecode(CropDecode):
    """torchvision's ``RandomResizedCrop(size, scale, ratio)`` (+ ``RandomHorizontalFlip()`` when ``flip``), fused
    with decoding. ``seed=None``: draws from a per-process stream seeded by ``torch.initial_seed()``, like
    torchvision (different per worker and epoch; reproducible under ``torch.manual_seed``). ``seed=S``: each
    sample's draws depend only on (S, epoch, index); call ``set_epoch`` each epoch (before the loader's
    iterator is made: persistent workers keep the epoch they started with). ``region=False``: decode the whole
    JPEG, then crop (the path without the compiled region decoder; for comparisons)."""

    def __init__(self, size: int | tuple[int, int] = 224, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True, seed: int | None = None,
                 region: bool = True) -> None:
        self.size, self.region = _size_pair(size), bool(region)
        if not 0 < scale[0] <= scale[1]:
            raise OptionError(f"crop scale {scale!r}: expected 0 < low <= high")
        if not 0 < ratio[0] <= ratio[1]:
            raise OptionError(f"crop ratio {ratio!r}: expected 0 < low <= high")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise OptionError(f"crop seed {seed!r}: expected None or an integer >= 0")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip, self.seed, self.epoch = bool(flip), seed, 0
        self._stream: PerProcess[np.random.PCG64] = PerProcess(_torch_seeded)

    def __repr__(self) -> str:
        return (f"RandomResizedCropDecode(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
                f"flip={self.flip}, seed={self.seed}, region={self.region})")

    def set_epoch(self, epoch: int) -> None:
        """The epoch that, with ``seed`` and the sample index, decides the crops (``seed=S`` only)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise OptionError(f"epoch {epoch!r}: expected an integer >= 0")
        self.epoch = epoch

    def draws(self, index: int) -> np.ndarray:
        """The uniforms sample ``index`` uses (``DRAWS`` of them)."""
        if self.seed is None:
            return _uniforms(self._stream.get().random_raw(DRAWS))
        return _uniforms(raw_draws(self.seed, self.epoch, index, n=DRAWS))

    def window(self, height: int, width: int, index: int) -> Window:
        return self._drawn_window(height, width, self.draws(index))

    def windows(self, heights: Sequence[int], widths: Sequence[int], indices: Sequence[int]) -> list[Window]:
        if self.seed is not None:
            return super().windows(heights, widths, indices)
        # one call for all: the same stream, in the same order, as one ``draws`` per sample
        u = _uniforms(self._stream.get().random_raw(DRAWS * len(indices))).reshape(len(indices), DRAWS)
        return [self._drawn_window(h, w, row) for h, w, row in zip(heights, widths, u, strict=True)]

    def position(self) -> object | None:
        return self._stream.get().state if self.seed is None else None

    def rewind(self, position: Any) -> None:
        if self.seed is None:
            self._stream.get().state = position

    def _drawn_window(self, height: int, width: int, u: np.ndarray) -> Window:
        top, left, h, w = crop_params(height, width, self.scale, self.ratio, u)
        return Window(top, left, h, w, self.flip and bool(u[DRAWS - 1] < 0.5))


class CenterCropDecode(CropDecode):
    """torchvision's ``Resize(resize)`` + ``CenterCrop(size)`` (the evaluation transform), fused with decoding:
    the window is the centre crop's rectangle mapped back to the source. ``region``: as RandomResizedCropDecode's."""

    def __init__(self, size: int | tuple[int, int] = 224, resize: int = 256, region: bool = True) -> None:
        self.size, self.region = _size_pair(size), bool(region)
        if isinstance(resize, bool) or not isinstance(resize, int) or resize < max(self.size):
            raise OptionError(f"resize {resize!r}: expected an int >= the crop size {max(self.size)}")
        self.resize = resize

    def __repr__(self) -> str:
        return f"CenterCropDecode(size={self.size}, resize={self.resize}, region={self.region})"

    def window(self, height: int, width: int, index: int) -> Window:
        # torchvision's Resize(int): the short side to `resize`, the long one truncated, int(resize * long / short)
        if height <= width:
            rh, rw = self.resize, int(self.resize * width / height)
        else:
            rh, rw = int(self.resize * height / width), self.resize
        ch, cw = self.size
        top, left = int(round((rh - ch) / 2.0)), int(round((rw - cw) / 2.0))  # CenterCrop's offsets
        sy, sx = height / rh, width / rw
        return Window(top * sy, left * sx, ch * sy, cw * sx)


# ------------------------------------------------------------------ decoding a window


def window_scale(window: Window, size: tuple[int, int]) -> int:
    """The largest DCT denominator d in 8, 4, 2 (else 1) whose 1/d-scaled window is still >= ``size``."""
    for d in SCALE_DENOMINATORS:
        if window.height / d >= size[0] and window.width / d >= size[1]:
            return d
    return 1


def _box(window: Window, d: int, height: int, width: int) -> tuple[float, float, float, float]:
    """(top, left, bottom, right) of ``window`` on the 1/d grid of an image now ``height`` x ``width``, inside it."""
    top = min(max(window.top / d, 0.0), height - 1.0)
    left = min(max(window.left / d, 0.0), width - 1.0)
    bottom = min(max((window.top + window.height) / d, top + 1.0), float(height))
    right = min(max((window.left + window.width) / d, left + 1.0), float(width))
    return top, left, bottom, right


def resize_window(pixels: np.ndarray, window: Window, size: tuple[int, int], d: int = 1,
                  out: np.ndarray | None = None) -> np.ndarray:
    """``window`` (full-resolution pixels) of HWC uint8 ``pixels`` decoded at 1/d, resized to ``size`` with
    antialiased bilinear and flipped as the window says, into ``out`` where it has the shape and is writable (else a
    new array, never a view that keeps a whole decoded image alive). A window on whole pixels is cut out and resized
    by torch (torchvision's ``resized_crop`` on uint8 tensors, faster than PIL); a fractional one (a DCT
    scale, the eval window) by PIL's BILINEAR with that exact box (torchvision's PIL path, within 1 of it)."""
    if out is None or not writable_as(out, (*size, 3)):
        out = np.empty((*size, 3), np.uint8)
    top, left, bottom, right = _box(window, d, pixels.shape[0], pixels.shape[1])
    if all(float(v).is_integer() for v in (top, left, bottom, right)):
        region = pixels[int(top):int(bottom), int(left):int(right)]
        if (region.shape[0], region.shape[1]) == size:
            np.copyto(out, region[:, ::-1] if window.flip else region)
            return out
        if not region.flags.writeable:
            region = region.copy()  # torch wants writable memory (raw payloads are read-only views)
        _resize_into(region, out)
    else:
        img = Image.fromarray(pixels).resize((size[1], size[0]), Image.Resampling.BILINEAR,
                                             box=(left, top, right, bottom))
        np.copyto(out, np.asarray(img))
    if window.flip:
        flipped = torch.from_numpy(out)
        flipped.copy_(flipped.flip(1))  # torch's flip of HWC rows: far cheaper than numpy's out[:, ::-1] copy
    return out


def _resize_into(region: np.ndarray, out: np.ndarray) -> None:
    """HWC uint8 ``region`` resized into HWC ``out`` by torch's antialiased bilinear (``F.interpolate``'s kernel,
    the same pixels). Given as channels-last tensors, torch's uint8 kernel reads and writes them in place; through
    ``F.interpolate`` it returns NCHW, a conversion plus a CHW -> HWC copy."""
    src = torch.from_numpy(region).permute(2, 0, 1)[None]
    dst = torch.from_numpy(out).permute(2, 0, 1)[None]
    torch.ops.aten._upsample_bilinear2d_aa.out(src, list(out.shape[:2]), False, None, None, out=dst)


def _region(box: tuple[float, float, float, float], size: tuple[int, int], height: int,
            width: int) -> tuple[int, int, int, int]:
    """(top, left, bottom, right) of the whole pixels the resize of ``box`` reads: a box on whole pixels itself
    (``resize_window`` cuts it out), else the box rounded out plus PIL's bilinear filter's reach past its edges
    (one output pixel's worth of source, and one more), inside the image."""
    top, left, bottom, right = box
    if all(float(v).is_integer() for v in box):
        return int(top), int(left), int(bottom), int(right)
    reach = math.ceil(max((bottom - top) / size[0], (right - left) / size[1], 1.0)) + 1
    return (max(math.floor(top) - reach, 0), max(math.floor(left) - reach, 0),
            min(math.ceil(bottom) + reach, height), min(math.ceil(right) + reach, width))


def _plan(window: Window, size: tuple[int, int], d: int, height: int, width: int
          ) -> tuple[tuple[int, int, int, int], Window]:
    """The whole pixels (top, left, bottom, right) on the 1/d grid that the resize of ``window`` reads, and the
    window moved onto them (what ``resize_window`` is given for the region's pixels)."""
    hs, ws = -(-height // d), -(-width // d)
    box = _box(window, d, hs, ws)
    y0, x0, y1, x1 = _region(box, size, hs, ws)
    top, left, bottom, right = box[0] - y0, box[1] - x0, box[2] - y0, box[3] - x0
    return (y0, x0, y1, x1), Window(top * d, left * d, (bottom - top) * d, (right - left) * d, window.flip)


def _decode_region(data: bytes | memoryview, window: Window, size: tuple[int, int], d: int, height: int,
                   width: int, strict: bool, out: np.ndarray | None) -> np.ndarray | None:
    """``decode_window`` decoding only the rows and columns the window's resize reads (None: CMYK/YCCK, decode
    whole). The region decode is exact, so the output is the whole-decode path's for a box on whole pixels and
    within 1 of it otherwise (PIL places its filter on the shifted box with different float rounding)."""
    (y0, x0, y1, x1), shifted = _plan(window, size, d, height, width)
    pixels = decode_region(data, d, y0, x0, y1 - y0, x1 - x0, (height, width), strict)
    if pixels is None:
        return None
    return resize_window(pixels, shifted, size, d, out)


class _Scratch(threading.local):
    """Per thread, the memory ``decode_windows`` decodes regions into, kept for its next call (fresh memory costs
    a page fault per 4 KiB on first touch); up to ``KEEP`` bytes, a larger call's memory is not kept."""

    KEEP = 64 << 20
    block = np.empty(0, np.uint8)

    def views(self, shapes: list[tuple[int, int]]) -> list[np.ndarray]:
        total = sum(h * w * 3 for h, w in shapes)
        block = self.block if self.block.nbytes >= total else np.empty(total, np.uint8)
        if total <= self.KEEP:
            self.block = block
        out, start = [], 0
        for h, w in shapes:
            out.append(block[start:start + h * w * 3].reshape(h, w, 3))
            start += h * w * 3
        return out


_scratch = _Scratch()


def spread(status: bytes, tried: Sequence[int], n: int) -> bytes:
    """Per item of ``n``, the ``status`` of those ``tried`` (the positions ``status`` is of), 0 for the others."""
    out = bytearray(n)
    for k, ok in zip(tried, status, strict=True):
        out[k] = ok
    return bytes(out)


def decode_windows(datas: Sequence[bytes | memoryview], windows: Sequence[Window], size: tuple[int, int],
                   heights: Sequence[int], widths: Sequence[int], outs: Sequence[np.ndarray],
                   strict: bool = False) -> bytes | None:
    """``decode_window`` for many JPEGs (region decode), each into ``outs[k]`` (``size`` HWC uint8 C-contiguous,
    writable): every region decoded by one call of the compiled extension without the GIL, then resized one by one,
    the same pixels. Per item 1 where done; 0 or 2 where not: not a JPEG, CMYK, damaged data (2), a size above the
    pixel limit (no memory allocated for it), a header unlike ``heights``/``widths`` (check headers first:
    ``decode_window`` itself trusts the size it is given). None: the region decoder not built."""
    if not region_decode_available():
        return None
    limit = pixel_limit()
    tried, plans, regions = [], [], []
    for k, (window, height, width) in enumerate(zip(windows, heights, widths, strict=True)):
        if height < 1 or width < 1 or (limit is not None and height * width > limit):
            continue  # no region memory on the word of sizes the one-by-one path refuses
        d = window_scale(window, size)
        (y0, x0, y1, x1), shifted = _plan(window, size, d, height, width)
        tried.append(k)
        plans.append((d, (y1 - y0, x1 - x0), shifted))
        regions.append((d, y0, x0, height, width))
    bufs = _scratch.views([shape for _, shape, _ in plans])
    status = decode_regions([datas[k] for k in tried], np.array(regions, dtype=np.int64).reshape(-1, 5), bufs, strict)
    if status is None:
        return None
    done = bytearray(status)
    for j, (k, (d, _, shifted)) in enumerate(zip(tried, plans, strict=True)):
        if done[j] == 1 and resize_window(bufs[j], shifted, size, d, outs[k]) is not outs[k]:
            done[j] = 0  # an out it could not write into (shape, type, read-only): the caller's one-by-one path
    return spread(bytes(done), tried, len(windows))


def decode_window(data: bytes | memoryview, window: Window, size: tuple[int, int], height: int, width: int,
                  backend: str = "auto", strict: bool = True, out: np.ndarray | None = None,
                  region: bool = True) -> np.ndarray:
    """Encoded image bytes (``height`` x ``width`` per their header) decoded at the smallest DCT scale the
    window allows (JPEG; other formats at full size), then ``resize_window``. A JPEG decodes only the window's
    region where the compiled region decoder is built (packer.images.jpegregion), ``backend`` is not "pil" and
    ``region`` is True."""
    jpeg = sniff(data) == "jpeg"
    d = window_scale(window, size) if jpeg else 1
    if jpeg and backend != "pil" and region:
        if region_decode_available():
            result = _decode_region(data, window, size, d, height, width, strict, out)
            if result is not None:
                return result
        else:
            notice_missing()
    # decode()'s min_size picks the largest d whose short side stays >= min_size: ceil(short / d) gives this d
    short = min(height, width)
    pixels = decode(data, backend, strict=strict, min_size=-(-short // d) if d > 1 else None)
    scaled = d > 1 and pixels.shape[0] == -(-height // d)  # else the decoder gave the full size
    return resize_window(pixels, window, size, d if scaled else 1, out)
