"""Read rates of the bmp and mosaic formats, one process, warm page cache (the decode term, not IO).

BMP: our numpy reader vs Pillow's BMP decoder on the same .bmp files, vs decoding the source
JPEGs (Pillow, and libjpeg-turbo when present). Mosaic: tiles/s per codec and tile path, in
sequential order (neighbours follow: the block sampler's case) and in uniform random order.
Figures are medians of ``--repeats`` interleaved runs; each run stops after ``--budget``
seconds, so slow paths (a whole PNG mosaic decoded per random tile) finish too.

    packer sample demo/imgs --count 2000 --classes 10
    python examples/bmp_mosaic_speed.py demo/imgs --limit 1000 --tile 224x224 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from packer import convert, open_dataset
from packer.formats import bmp as bmp_format
from packer.formats import mosaic
from packer.images import bmp as bmpfile
from packer.images.decode import decode, turbojpeg_handle
from packer.write.scan import scan_folder


def rate(fn: Callable[[int], object], order: list[int], budget: float) -> float:
    """Items per second of ``fn`` over ``order``, stopping after ``budget`` seconds."""
    start = time.perf_counter()
    done = 0
    for i in order:
        fn(i)
        done += 1
        if time.perf_counter() - start > budget:
            break
    return done / (time.perf_counter() - start)


def median_rates(tasks: dict[str, tuple[Callable, list[int]]], repeats: int, budget: float) -> dict[str, float]:
    runs: dict[str, list[float]] = {k: [] for k in tasks}
    for _ in range(repeats):  # interleaved: load drifts hit every task alike
        for name, (fn, order) in tasks.items():
            runs[name].append(rate(fn, order, budget))
    return {k: statistics.median(v) for k, v in runs.items()}


def tile_reader(out: Path, shard, tile_read: str, first: int) -> Callable[[int], np.ndarray]:
    """Reads tiles; a fresh reader (cold per-process cache) at the start of each timed run."""
    state: dict = {}

    def read(i: int) -> np.ndarray:
        if "reader" not in state or i == first:
            state["reader"] = mosaic.Reader(out, shard, "raw", tile_read=tile_read)
        return state["reader"].read(i)

    return read


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path, help="folder of JPEGs (e.g. from packer sample)")
    ap.add_argument("--limit", type=int, default=1000, help="images used (first N of the scan)")
    ap.add_argument("--tile", default="224x224")
    ap.add_argument("--quality", type=int, default=95, help="jpeg mosaic quality")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=3.0, help="seconds per timed run at most")
    ap.add_argument("--workdir", type=Path, default=None, help="where converted copies go (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="packer-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    scan = scan_folder(args.source)
    src = work / "src"
    if not src.exists():  # the first --limit images, same tree
        for rel in scan.rel_paths[: args.limit]:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).symlink_to((scan.root / rel).resolve())
    report: dict = {"source": str(args.source), "images": min(args.limit, len(scan)), "tile": args.tile}

    # ------------------------------------------------------------ BMP vs Pillow BMP vs JPEG
    bmp_ds_path = work / "imgs.bmp"
    if not bmp_ds_path.exists():
        convert(src, bmp_ds_path, to="bmp", progress=False)
    ds = open_dataset(bmp_ds_path, image="numpy")
    rels = ds.index.rel_paths()
    bmp_files = [bmp_ds_path / bmp_format.bmp_name(r) for r in rels]
    jpeg_bytes = [(src / r).read_bytes() for r in rels]
    bmp_bytes = [f.read_bytes() for f in bmp_files]
    order = list(range(len(rels)))

    def pil_bmp_file(i: int):
        with Image.open(bmp_files[i]) as img:
            return np.asarray(img.convert("RGB"))

    tasks = {
        "bmp: packer reader (file read + numpy)": (lambda i: bmpfile.read(bmp_files[i]), order),
        "bmp: packer dataset ds[i] (numpy)": (lambda i: ds[i], order),
        "bmp: Pillow open+convert (file)": (pil_bmp_file, order),
        "bmp: packer decode from memory": (lambda i: bmpfile.decode(bmp_bytes[i], bmpfile.parse_header(
            bmp_bytes[i], len(bmp_bytes[i]), i)), order),
        "bmp: Pillow decode from memory": (lambda i: np.asarray(Image.open(io.BytesIO(bmp_bytes[i])).convert("RGB")),
                                           order),
        "jpeg: Pillow decode from memory": (lambda i: decode(jpeg_bytes[i], "pil"), order),
    }
    if turbojpeg_handle() is not None:
        tasks["jpeg: libjpeg-turbo decode from memory"] = (lambda i: decode(jpeg_bytes[i], "turbojpeg"), order)
    bmp_rates = median_rates(tasks, args.repeats, args.budget)
    report["bmp"] = {"img_per_s": bmp_rates, "disk_bytes": {"bmp": disk_bytes(bmp_ds_path / "images"),
                                                             "jpeg sources": sum(map(len, jpeg_bytes))}}

    # ------------------------------------------------------------ mosaic tile paths
    mosaic_rates: dict[str, dict[str, float]] = {}
    sizes = {}
    rng = np.random.default_rng(0)
    for codec in ("bmp", "png", "jpeg"):
        out = work / f"imgs.mosaic-{codec}"
        if not out.exists():
            convert(src, out, to="mosaic", tile=args.tile, codec=codec,
                    quality=args.quality if codec == "jpeg" else None, progress=False)
        m = open_dataset(out).manifest
        shard = m.shards[0]
        sizes[codec] = {"disk_bytes": disk_bytes(out), "grid": shard.facts["grid"], "mosaics": len(m.shards[0].facts[
            "samples_per_mosaic"])}
        n = m.num_samples
        seq, rnd = list(range(n)), rng.permutation(n).tolist()
        paths = {"bmp": ["region"], "png": ["full"], "jpeg": ["full", "segments", "crop"]}[codec]
        tasks = {}
        for tile_read in paths:
            if tile_read == "crop" and turbojpeg_handle() is None:
                continue
            for order_name, order in (("sequential", seq), ("random", rnd)):
                tasks[f"{codec}/{tile_read}/{order_name}"] = (tile_reader(out, shard, tile_read, order[0]), order)
        mosaic_rates.update(median_rates(tasks, args.repeats, args.budget))
    report["mosaic"] = {"tiles_per_s": mosaic_rates, "files": sizes}

    print(f"# {report['images']} images from {args.source}, one process, warm page cache\n")
    print("| read path | img/s | vs Pillow BMP | vs Pillow JPEG |\n|---|---:|---:|---:|")
    pil_bmp = bmp_rates["bmp: Pillow open+convert (file)"]
    pil_jpg = bmp_rates["jpeg: Pillow decode from memory"]
    for k, v in bmp_rates.items():
        print(f"| {k} | {v:,.0f} | {v / pil_bmp:.2f}x | {v / pil_jpg:.2f}x |")
    print(f"\nBMP on disk {report['bmp']['disk_bytes']['bmp'] / 1e6:.0f} MB vs JPEG sources "
          f"{report['bmp']['disk_bytes']['jpeg sources'] / 1e6:.0f} MB\n")
    print(f"| mosaic codec / tile path / order ({args.tile} tiles) | tiles/s | ms/tile |\n|---|---:|---:|")
    for k, v in mosaic_rates.items():
        print(f"| {k} | {v:,.1f} | {1e3 / v:.2f} |")
    print()
    for codec, info in sizes.items():
        print(f"- {codec}: grid {info['grid'][0]}x{info['grid'][1]}, {info['mosaics']} mosaics, "
              f"{info['disk_bytes'] / 1e6:.0f} MB on disk")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
