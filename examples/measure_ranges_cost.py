"""What recording payload ranges (packer/write/ranges.py, for ranged reads by URL) adds to a conversion: the
conversion's time, and record_ranges timed again on the finished dataset (its shards read back through the format's
reader and CRC-32 hashed; the pages still cached, as right after a conversion).

    python examples/measure_ranges_cost.py [--count 2000] [--formats lmdb memmap]

Synthetic photos (packer's generator, 500x375 JPEGs), shards of 8 MB. Figures go to docs/remote.md with this command.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import packer
from packer.layout.manifest import read_manifest
from packer.tools.sample import make_sample
from packer.write.ranges import record_ranges


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--formats", nargs="+", default=["lmdb", "memmap"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_sample(Path(tmp) / "imgs", count=args.count, progress=False)
        for fmt in args.formats:
            out = Path(tmp) / f"ds.{fmt}"
            start = time.perf_counter()
            packer.convert(Path(tmp) / "imgs", out, to=fmt, shard_bytes=8 << 20, progress=False)
            convert_s = time.perf_counter() - start
            with packer.open_dataset(out) as ds:
                start = time.perf_counter()
                ranges = record_ranges(out, read_manifest(out), ds.store.index)
                record_s = time.perf_counter() - start
            print(f"{fmt}: convert {convert_s:.2f} s (recording included), record_ranges {record_s:.2f} s "
                  f"({100 * record_s / convert_s:.0f}%), ranges recorded: {ranges is not None}")


if __name__ == "__main__":
    main()
