"""What asking "is this batch cached?" costs on an LMDB shard whose values are cached and B-tree pages are not.

    python examples/measure_residency_check.py photos.lmdb

The page cache is emptied of the shard, every value is read back (nothing else: packer reads values as views
and never touches the B-tree pages again once it has located them), then 40 batches of 256 random samples are
checked with ``PageCache.resident`` as the reader asks it (``holding``: only the pages that hold values count
when the whole file is checked) and as it asked before (the whole file must be cached for the quick answer).
CPU microseconds per batch; figures in docs/results.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import packer
from packer.diagnose.measure import evict
from packer.pagecache import PageCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lmdb")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    ds = packer.open_dataset(a.lmdb)
    reader = ds.store.readers[0]
    spans = reader._get().spans  # (leaf page, value start, value end) per sample
    evict([reader.path])
    for k in range(0, len(ds), 256):  # the values only
        b"".join(ds.read_payloads(np.arange(k, min(k + 256, len(ds)))))
    rng = np.random.default_rng(0)
    batches = [np.sort(rng.choice(len(ds), min(256, len(ds)), replace=False)) for _ in range(40)]
    for r in range(a.rounds):
        row = []
        for name, cache in (("values only (holding)", PageCache(reader.path, holding=(spans[:, 1], spans[:, 2]))),
                            ("whole file", PageCache(reader.path))):
            t, cached = time.process_time(), 0
            for b in batches:
                cached += cache.resident(spans[b, 1], spans[b, 2])
            row.append(f"{name} {(time.process_time() - t) / len(batches) * 1e6:,.0f} us ({cached}/40 cached)")
            cache.close()
        print(f"round {r + 1}: " + "; ".join(row))


if __name__ == "__main__":
    main()
