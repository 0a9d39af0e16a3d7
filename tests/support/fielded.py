"""Datasets with every kind of per-sample field, written through the public Writer, and what they should hold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from packer.write.writer import Writer
from support.imagesets import jpeg_bytes

SPECS = {"boxes": "float32[:,4]", "caption": "str", "count": "int", "score": "float", "meta": "json",
         "blob": "bytes", "mask": "uint8[2,3]"}
FORMAT_OPTIONS: dict[str, dict[str, Any]] = {"mosaic": {"tile": "16x16"}}


def sample(i: int, rng: np.random.Generator) -> dict[str, Any]:
    """Sample ``i``: a real JPEG, a label and one value of every field kind (ragged boxes: 0 to 3 rows)."""
    return {"image": jpeg_bytes(rng, 20 + i % 5, 28 + i % 3), "label": i % 3,
            "boxes": rng.random((i % 4, 4)).astype(np.float32), "caption": f"photo {i}: ünïcode",
            "count": i * 1_000_003 - 7, "score": float(rng.random()), "meta": {"i": i, "tags": ["a", None]},
            "blob": bytes(range(i % 7)), "mask": np.full((2, 3), i, np.uint8)}


def write_fielded(out: Path | str, fmt: str = "lmdb", count: int = 7, seed: int = 0, stop_after: int | None = None,
                  **options: Any) -> list[dict[str, Any]]:
    """Write ``count`` samples with SPECS to ``out`` (a folder, or a URL); returns them. ``stop_after``: raise (like
    a crash) after that many samples, leaving ``out.partial``."""
    rng = np.random.default_rng(seed)
    samples = [sample(i, rng) for i in range(count)]
    with Writer(out, format=fmt, fields=SPECS, **{**FORMAT_OPTIONS.get(fmt, {}), **options}) as w:
        for k, s in enumerate(samples):
            if stop_after is not None and k == stop_after:
                raise KeyboardInterrupt("simulated kill")
            w.add(**s)
    return samples


def same_value(got: Any, want: Any) -> bool:
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape \
            and bool(np.array_equal(got, want))
    return type(got) is type(want) and got == want
