"""What decoding only the crop's region saves, per core: CPU milliseconds per image of a whole JPEG decode, of the
region decode of a RandomResizedCrop(224) window, and of the fused crop (decode + resize + flip into a 224x224
slot) both ways, on the same bytes and windows, in one process with one torch thread; and the same on the
bytes ``convert --jpeg-restarts`` stores (a restart marker per MCU: a region decodes from its own MCUs).

    python examples/region_decode_speed.py PHOTOS/ --count 200 --repeats 5

PHOTOS is a folder of JPEGs (``packer sample PHOTOS --count 200``). CPU time, medians of ``--repeats`` passes:
steadier than wall time on a shared machine. Needs the compiled region decoder (setup.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from packer import RandomResizedCropDecode
from packer.images.crop import decode_window
from packer.images.decode import decode
from packer.images.headers import image_size
from packer.images.jpegregion import decode_region, region_decode_available, restart_transcode


def cpu_ms(cases: dict, count: int, repeats: int) -> dict[str, float]:
    """Median CPU milliseconds per image of each case's ``work()`` (one pass over ``count`` images), the cases
    taking turns so that a busier moment of the machine falls on all of them."""
    runs: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, work in cases.items():
            t0 = time.process_time()
            work()
            runs[name].append((time.process_time() - t0) * 1000 / count)
    return {name: statistics.median(v) for name, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if not region_decode_available():
        raise SystemExit("the JPEG region decoder is not built: python setup.py build_ext --inplace")
    torch.set_num_threads(1)
    datas = [p.read_bytes() for p in sorted(a.folder.rglob("*.jp*g"))[:a.count]]
    sizes = [image_size(d) for d in datas]
    spec = RandomResizedCropDecode(224, seed=0)
    wins = [spec.window(h, w, i) for i, (h, w) in enumerate(sizes)]
    out = np.empty((224, 224, 3), np.uint8)
    n = len(datas)
    marked = [restart_transcode(d) or d for d in datas]

    def region(bytes_):
        return lambda: [decode_region(d, 1, int(w.top), int(w.left), int(w.height), int(w.width), s)
                        for d, w, s in zip(bytes_, wins, sizes)]

    def fused(bytes_, whole=False):
        return lambda: [decode_window(d, w, spec.size, *s, out=out, region=not whole)
                        for d, w, s in zip(bytes_, wins, sizes)]

    cases = {
        "whole decode": lambda: [decode(d) for d in datas],
        "region decode": region(datas),
        "fused crop, whole decode": fused(datas, whole=True),
        "fused crop, region decode": fused(datas),
        "restarts: whole decode": lambda: [decode(d) for d in marked],
        "restarts: region decode": region(marked),
        "restarts: fused crop": fused(marked),
    }
    ms = cpu_ms(cases, n, a.repeats)
    area = np.mean([w.height * w.width / (h * ww) for w, (h, ww) in zip(wins, sizes)])
    print(f"{n} JPEGs, mean {np.mean([len(d) for d in datas]) / 1e3:.0f} KB (rewritten with restart markers: "
          f"{np.mean([len(d) for d in marked]) / 1e3:.0f} KB); crops cover {area:.0%} of the image")
    for name, v in ms.items():
        print(f"{name:<28} {v:6.3f} ms/img  {1000 / v:6.0f} img/s per core")
    print(f"region / whole: decode {ms['whole decode'] / ms['region decode']:.2f}x, "
          f"fused {ms['fused crop, whole decode'] / ms['fused crop, region decode']:.2f}x; with restart markers: "
          f"decode {ms['whole decode'] / ms['restarts: region decode']:.2f}x, "
          f"fused {ms['fused crop, whole decode'] / ms['restarts: fused crop']:.2f}x "
          f"({ms['fused crop, region decode'] / ms['restarts: fused crop']:.2f}x the region decode without them); "
          f"a whole decode {ms['restarts: whole decode'] / ms['whole decode']:.2f}x the time")


if __name__ == "__main__":
    main()
