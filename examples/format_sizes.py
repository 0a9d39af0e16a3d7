"""Size on disk of each format and payload for one source folder, as a Markdown table.

    packer sample imgs/ --count 2000 --classes 10
    python examples/format_sizes.py imgs/                 # in a temporary folder, removed at the end
    python examples/format_sizes.py imgs/ --out packed/   # kept under packed/ (and reused when run again)

Converts ``imgs/`` into each variant below and prints bytes on disk (every file of the dataset directory, as
``du -b`` counts them), the ratio to the source folder's bytes and the conversion rate. Decoded pixels are
large: the variants add up to about 50 times the source folder's bytes. Before writing anything the script
says how much it will write and where. Without ``--out`` each variant is deleted once measured, so only one
variant (at most the largest: raw full-size pixels, about 6 times the source) is on disk at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from packer import FORMATS, convert
from packer.images.headers import image_size
from packer.images.resize import ResizeSpec
from packer.units import human_bytes
from packer.write.scan import IMG_EXTENSIONS

VARIANTS = [  # (name, format, options)
    ("lmdb", "lmdb", {}),
    ("hdf5", "hdf5", {}),
    ("memmap", "memmap", {}),
    ("recordio", "recordio", {}),
    ("n5", "n5", {}),
    ("pth", "pth", {}),
    ("safetensors", "safetensors", {}),
    ("hdf5 raw", "hdf5", {"payload": "raw"}),
    ("memmap raw", "memmap", {"payload": "raw"}),
    ("hdf5 raw 256", "hdf5", {"payload": "raw", "resize": "256"}),
    ("hdf5 raw 256 gzip", "hdf5", {"payload": "raw", "resize": "256", "compression": "gzip"}),
    ("hdf5 raw 256 lzf", "hdf5", {"payload": "raw", "resize": "256", "compression": "lzf"}),
    ("memmap raw 256", "memmap", {"payload": "raw", "resize": "256"}),
    ("hdf5 raw 224x224", "hdf5", {"payload": "raw", "resize": "224x224"}),
    ("memmap raw 224x224", "memmap", {"payload": "raw", "resize": "224x224"}),
    ("lmdb raw 224x224", "lmdb", {"payload": "raw", "resize": "224x224"}),
    ("n5 raw 224x224", "n5", {"payload": "raw", "resize": "224x224"}),
    ("n5 raw 224x224 gzip", "n5", {"payload": "raw", "resize": "224x224", "compression": "gzip"}),
    ("pth raw 224x224", "pth", {"payload": "raw", "resize": "224x224"}),
    ("safetensors raw 224x224", "safetensors", {"payload": "raw", "resize": "224x224"}),
    ("bmp 256", "bmp", {"resize": "256"}),
    ("bmp 224x224", "bmp", {"resize": "224x224"}),
    ("mosaic bmp 224x224", "mosaic", {"tile": "224x224"}),
    ("mosaic png 224x224", "mosaic", {"tile": "224x224", "codec": "png"}),
    ("mosaic jpeg q95 224x224", "mosaic", {"tile": "224x224", "codec": "jpeg", "quality": 95}),
]
PROBES = 200  # image headers read to estimate the pixels of decoded variants


def tree_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def image_files(src: Path) -> list[Path]:
    return sorted(Path(d, f) for d, _, files in os.walk(src) for f in files if f.lower().endswith(IMG_EXTENSIONS))


def header_shapes(files: Sequence[Path]) -> list[tuple[int, int]]:
    """(height, width) of up to PROBES images spread over ``files``, from their headers."""
    shapes = []
    for i in sorted({int(k) for k in np.linspace(0, len(files) - 1, num=min(len(files), PROBES))}):
        try:
            with open(files[i], "rb") as fh:
                shapes.append(image_size(fh.read(1 << 20)))
        except Exception:  # noqa: BLE001 - a damaged file is left out of the estimate, as convert leaves it out
            continue
    return shapes


def estimate(fmt: str, opts: dict, count: int, encoded_bytes: int, shapes: Sequence[tuple[int, int]]) -> int:
    """Bytes a variant will write, about: the files' bytes for encoded payloads, else the pixels (uncompressed)."""
    payload = opts.get("payload") or ("encoded" if "encoded" in FORMATS[fmt].payloads else "raw")
    if payload == "encoded":
        return encoded_bytes
    spec = ResizeSpec.parse(opts.get("tile") or opts.get("resize"))
    per_image = [3 * int(np.prod(spec.output_shape(h, w) if spec else (h, w))) for h, w in shapes] or [0]
    return int(count * float(np.mean(per_image)))


def announce(src: Path, out: Path, kept: bool, sizes: dict[str, int], count: int) -> None:
    """What the run will write, and where, before it writes anything (stderr: stdout is the table)."""
    total, largest = sum(sizes.values()), max(sizes, key=lambda k: sizes[k])
    where = (f"under {out} (kept; variants already there are reused)" if kept else
             f"in the temporary folder {out}, each deleted once measured: at most {human_bytes(sizes[largest])} "
             "at a time (--out DIR keeps them)")
    print(f"format_sizes: {len(sizes)} variants of {src} ({count:,} images) write about {human_bytes(total)} in all, "
          f"the largest {largest} ({human_bytes(sizes[largest])}), {where}", file=sys.stderr, flush=True)


def measure(src: Path, out: Path, kept: bool, workers: int | None, variants: list) -> None:
    base = tree_bytes(src)
    print("| dataset | payload | options | bytes on disk | vs source | conversion |\n|---|---|---|---|---|---|")
    print(f"| {src} (loose files) | | | {base:,} | 1.00 | |")
    for name, fmt, opts in variants:
        path = out / (name.replace(" ", "-") + "." + fmt)
        rate = ""
        if not (path / "manifest.json").exists():
            res = convert(src, path, to=fmt, workers=workers, progress=False, overwrite=True, **opts)
            rate = f"{res.files_per_second:,.0f} files/s"
        size = tree_bytes(path)
        extra = ", ".join(f"{k}={v}" for k, v in opts.items() if k != "payload")
        payload = json.loads((path / "manifest.json").read_text())["payload"]
        print(f"| {path.name} | {payload} | {extra} | {size:,} | {size / base:.2f} | {rate} |", flush=True)
        if not kept:
            shutil.rmtree(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("--out", help="folder for the converted datasets, kept (default: a temporary folder, removed)")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    src = Path(args.source)
    files = image_files(src)
    if not files:
        raise SystemExit(f"format_sizes: {src}: no images found")
    variants = [v for v in VARIANTS if v[1] in FORMATS]
    encoded, shapes = sum(f.stat().st_size for f in files), header_shapes(files)
    sizes = {name: estimate(fmt, opts, len(files), encoded, shapes) for name, fmt, opts in variants}
    kept = args.out is not None
    out = Path(args.out) if kept else Path(tempfile.mkdtemp(prefix="packer-format-sizes-"))
    announce(src, out, kept, sizes, len(files))
    try:
        out.mkdir(parents=True, exist_ok=True)
        measure(src, out, kept, args.workers, variants)
    finally:
        if not kept:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
