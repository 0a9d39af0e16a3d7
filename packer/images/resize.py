"""Resize-on-write for raw payloads: ``S`` (short side to S) or ``HxW`` (exact, fit or stretch).

Lossy and explicit: the manifest records the spec. Downscaling is antialiased (Pillow's
``reduce`` then Lanczos, ``reducing_gap=3``: close to a full Lanczos, several times faster).
Images are never enlarged unless ``upscale`` is set: an image smaller than the target keeps
its size (short-side mode) or is padded with black, centred, up to the exact shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from PIL import Image

from packer.errors import OptionError, arg
from packer.images.decode import check_pixels

RESIZE_MODES = ("stretch", "fit")


@dataclass(frozen=True)
class ResizeSpec:
    short_side: int | None = None  # "S": short side to S, aspect kept
    height: int | None = None  # "HxW": exact output shape
    width: int | None = None
    mode: str = "stretch"  # for HxW: stretch to the shape, or fit inside it and pad (letterbox)
    upscale: bool = False

    @classmethod
    def parse(cls, text: str | None, mode: str = "stretch", upscale: bool = False,
              option: str = "resize") -> ResizeSpec | None:
        """The spec ``text`` gives (None for none); ``option``: the option the user gave it as, for messages."""
        if text is None or str(text).strip() == "":
            return None
        if mode not in RESIZE_MODES:
            raise OptionError(f"unknown resize mode {mode!r} (choose {' or '.join(RESIZE_MODES)})")
        text = str(text).strip().lower()
        if m := re.fullmatch(r"(\d+)", text):
            spec = cls(short_side=int(m.group(1)), mode=mode, upscale=upscale)
        elif m := re.fullmatch(r"(\d+)x(\d+)", text):
            spec = cls(height=int(m.group(1)), width=int(m.group(2)), mode=mode, upscale=upscale)
        else:
            raise OptionError(f"{arg(option, text)}: expected S (short side) or HxW, e.g. 256 or 224x224")
        if min(v for v in (spec.short_side, spec.height, spec.width) if v is not None) < 1:
            raise OptionError(f"{arg(option, text)}: sizes must be at least 1")
        return spec

    def __str__(self) -> str:
        return str(self.short_side) if self.short_side else f"{self.height}x{self.width}"

    @property
    def fixed_shape(self) -> tuple[int, int] | None:
        """(H, W) every output has, or None when shapes vary (short-side mode)."""
        return (self.height, self.width) if self.height and self.width else None

    def scaled_size(self, h: int, w: int) -> tuple[int, int]:
        """(h, w) the image is resized to, before any padding."""
        if self.short_side:
            scale = self.short_side / min(h, w)
            if scale >= 1.0 and not self.upscale:
                return h, w
            if h <= w:
                return self.short_side, max(1, round(w * scale))
            return max(1, round(h * scale)), self.short_side
        th, tw = self.fixed_shape or (h, w)  # parse() sets either short_side or both sides
        if self.mode == "fit":
            scale = min(th / h, tw / w)
            if not self.upscale:
                scale = min(scale, 1.0)
            return min(th, max(1, round(h * scale))), min(tw, max(1, round(w * scale)))
        sh, sw = th / h, tw / w
        if not self.upscale:
            sh, sw = min(sh, 1.0), min(sw, 1.0)
        return max(1, round(h * sh)), max(1, round(w * sw))

    def output_shape(self, h: int, w: int) -> tuple[int, int]:
        return self.fixed_shape or self.scaled_size(h, w)

    def apply(self, pixels: np.ndarray) -> np.ndarray:
        """Resize HWC uint8 RGB ``pixels`` to this spec."""
        h, w = pixels.shape[:2]
        th, tw = self.scaled_size(h, w)
        check_pixels(*self.output_shape(h, w), what="resizing to")  # an upscale may ask for more than a decode may
        if (th, tw) != (h, w):
            img = Image.fromarray(pixels).resize((tw, th), Image.Resampling.LANCZOS, reducing_gap=3.0)
            pixels = np.asarray(img)
        shape = self.fixed_shape
        if shape is not None and (th, tw) != shape:
            out = np.zeros((*shape, 3), dtype=np.uint8)
            top, left = (shape[0] - th) // 2, (shape[1] - tw) // 2
            out[top : top + th, left : left + tw] = pixels
            pixels = out
        return np.ascontiguousarray(pixels)
