"""Size on disk of each format and payload for one source folder, as a Markdown table.

    packer sample imgs/ --count 2000 --classes 10
    python examples/format_sizes.py imgs/ --out packed/

Converts ``imgs/`` into each variant below (under ``--out``, reused when already there) and
prints bytes on disk (every file of the dataset directory, as ``du -b`` counts them), the
ratio to the source folder's bytes and the conversion rate.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from packer import FORMATS, convert

VARIANTS = [  # (name, format, options)
    ("lmdb", "lmdb", {}),
    ("hdf5", "hdf5", {}),
    ("memmap", "memmap", {}),
    ("hdf5 raw", "hdf5", {"payload": "raw"}),
    ("memmap raw", "memmap", {"payload": "raw"}),
    ("hdf5 raw 256", "hdf5", {"payload": "raw", "resize": "256"}),
    ("hdf5 raw 256 gzip", "hdf5", {"payload": "raw", "resize": "256", "compression": "gzip"}),
    ("hdf5 raw 256 lzf", "hdf5", {"payload": "raw", "resize": "256", "compression": "lzf"}),
    ("memmap raw 256", "memmap", {"payload": "raw", "resize": "256"}),
    ("hdf5 raw 224x224", "hdf5", {"payload": "raw", "resize": "224x224"}),
    ("memmap raw 224x224", "memmap", {"payload": "raw", "resize": "224x224"}),
    ("lmdb raw 224x224", "lmdb", {"payload": "raw", "resize": "224x224"}),
    ("bmp 256", "bmp", {"resize": "256"}),
    ("bmp 224x224", "bmp", {"resize": "224x224"}),
    ("mosaic bmp 224x224", "mosaic", {"tile": "224x224"}),
    ("mosaic png 224x224", "mosaic", {"tile": "224x224", "codec": "png"}),
    ("mosaic jpeg q95 224x224", "mosaic", {"tile": "224x224", "codec": "jpeg", "quality": 95}),
]


def tree_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("--out", required=True, help="folder for the converted datasets")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args()
    src, out = Path(args.source), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = tree_bytes(src)
    print("| dataset | payload | options | bytes on disk | vs source | conversion |\n|---|---|---|---|---|---|")
    print(f"| {src} (loose files) | | | {base:,} | 1.00 | |")
    for name, fmt, opts in VARIANTS:
        if fmt not in FORMATS:
            continue
        path = out / (name.replace(" ", "-") + "." + fmt)
        rate = ""
        if not (path / "manifest.json").exists():
            res = convert(src, path, to=fmt, workers=args.workers, progress=False, overwrite=True, **opts)
            rate = f"{res.files_per_second:,.0f} files/s"
        size = tree_bytes(path)
        extra = ", ".join(f"{k}={v}" for k, v in opts.items() if k != "payload")
        payload = json.loads((path / "manifest.json").read_text())["payload"]
        print(f"| {path.name} | {payload} | {extra} | {size:,} | {size / base:.2f} | {rate} |")


if __name__ == "__main__":
    main()
