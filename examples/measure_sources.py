"""Conversion rate from an archive vs the same files in a folder, and peak memory vs the archive's size.

Makes a sample set (``packer sample``), tars it (and, for the memory check, a tar 10x larger: the
set repeated ten times), then converts the folder, the tar and a nested tar (one tar per class)
the same way (``--to lmdb``, ``--workers N``), median of ``--repeats`` interleaved runs. Peak RSS is
measured in a fresh process per conversion (the driver's, and its largest worker's), writing
``--rss-to`` (default hdf5: LMDB writes through a map of its output file, whose pages count in the
writer's RSS and grow with the output whatever the source). ``--repeats 0`` measures memory only.
Targets: tar >= 80 % of the folder's rate; peak RSS of the 10x tar within 1.2x of the 1x tar.

    python examples/measure_sources.py --workdir /tmp/msrc --count 2000 --workers 2 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from packer import convert
from packer.tools.sample import make_sample

_RSS_CHILD = r"""
import json, resource, sys
from packer import convert
convert(sys.argv[1], sys.argv[2], to=sys.argv[5], workers=int(sys.argv[3]), validate=sys.argv[4], progress=False)
kib = lambda who: resource.getrusage(who).ru_maxrss
print(json.dumps({"driver_mib": kib(resource.RUSAGE_SELF) / 1024, "worker_mib": kib(resource.RUSAGE_CHILDREN) / 1024}))
"""


def make_tars(imgs: Path, work: Path) -> dict[str, Path]:
    files = sorted(p for p in imgs.rglob("*.jpg"))
    tars = {"tar": work / "imgs.tar", "tar-10x": work / "imgs10.tar", "nested": work / "nested.tar"}
    with tarfile.open(tars["tar"], "w") as tf:
        for p in files:
            tf.add(p, arcname=p.relative_to(imgs).as_posix())
    with tarfile.open(tars["tar-10x"], "w") as tf:
        for k in range(10):
            for p in files:
                tf.add(p, arcname=f"{p.parent.name}/r{k}_{p.name}")
    with tarfile.open(tars["nested"], "w") as outer:
        for cls in sorted(d for d in imgs.iterdir() if d.is_dir()):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as inner:
                for p in sorted(cls.glob("*.jpg")):
                    inner.add(p, arcname=p.name)
            info = tarfile.TarInfo(f"{cls.name}.tar")
            info.size = buf.tell()
            buf.seek(0)
            outer.addfile(info, buf)
    return tars


def rate(src: Path, out: Path, workers: int, validate: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    res = convert(src, out, workers=workers, validate=validate, progress=False)
    return res.num_samples / (time.perf_counter() - started)


def peak_rss(src: Path, out: Path, workers: int, validate: str, to: str) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(src), str(out), str(workers), validate, to],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--count", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--validate", default="full", choices=("full", "header", "none"))
    ap.add_argument("--rss-to", default="hdf5", help="the format the memory runs write (default hdf5)")
    args = ap.parse_args()
    work = args.workdir
    imgs = work / "imgs"
    if not imgs.is_dir():
        make_sample(imgs, count=args.count, progress=False)
    tars = make_tars(imgs, work)
    sources = {"folder": imgs, "tar": tars["tar"], "nested tar": tars["nested"]}
    rates: dict[str, list[float]] = {k: [] for k in sources}
    for _ in range(args.repeats):
        for name, src in sources.items():
            rates[name].append(rate(src, work / "out.lmdb", args.workers, args.validate))
    med = {k: statistics.median(v) for k, v in rates.items() if v}
    for name, r in med.items():
        print(f"{name:<11} {r:8.0f} img/s  ({r / med['folder']:.0%} of the folder's)")
    one, ten = (peak_rss(tars[k], work / "out.x", args.workers, args.validate, args.rss_to) for k in ("tar", "tar-10x"))
    for who in ("driver_mib", "worker_mib"):
        print(f"peak RSS {who[:-4]:<6}: 1x tar {one[who]:6.0f} MiB, 10x tar {ten[who]:6.0f} MiB "
              f"({ten[who] / one[who]:.2f}x)")
    for out in ("out.lmdb", "out.x"):
        shutil.rmtree(work / out, ignore_errors=True)


if __name__ == "__main__":
    main()
