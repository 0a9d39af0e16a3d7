"""What decoding only the crop's region saves, per core: CPU milliseconds per image of a whole JPEG decode, of the
region decode of a RandomResizedCrop(224) window, and of the fused crop (decode + resize + flip into a 224x224
slot) both ways, on the same bytes and windows, in one process with one torch thread.

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
from packer.images.jpegregion import decode_region, region_decode_available


def cpu_ms(work, count: int, repeats: int) -> float:
    """Median CPU milliseconds per image of ``work()`` (one pass over ``count`` images)."""
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        work()
        runs.append((time.process_time() - t0) * 1000 / count)
    return statistics.median(runs)


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
    cases = {
        "whole decode": lambda: [decode(d) for d in datas],
        "region decode": lambda: [decode_region(d, 1, int(w.top), int(w.left), int(w.height), int(w.width), s)
                                  for d, w, s in zip(datas, wins, sizes)],
        "fused crop, whole decode": lambda: [decode_window(d, w, spec.size, *s, out=out, region=False)
                                             for d, w, s in zip(datas, wins, sizes)],
        "fused crop, region decode": lambda: [decode_window(d, w, spec.size, *s, out=out)
                                              for d, w, s in zip(datas, wins, sizes)],
    }
    ms = {name: cpu_ms(work, n, a.repeats) for name, work in cases.items()}
    area = np.mean([w.height * w.width / (h * ww) for w, (h, ww) in zip(wins, sizes)])
    print(f"{n} JPEGs, mean {np.mean([len(d) for d in datas]) / 1e3:.0f} KB; crops cover {area:.0%} of the image")
    for name, v in ms.items():
        print(f"{name:<28} {v:6.3f} ms/img  {1000 / v:6.0f} img/s per core")
    print(f"region / whole: decode {ms['whole decode'] / ms['region decode']:.2f}x, "
          f"fused {ms['fused crop, whole decode'] / ms['fused crop, region decode']:.2f}x")


if __name__ == "__main__":
    main()
