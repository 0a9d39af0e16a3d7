"""Cold passes over an LMDB dataset with the kernel's read-ahead on and off (``access=``).

    python examples/lmdb_readahead.py demo/imgs.lmdb --repeats 3

``access="sequential"`` opens LMDB with ``readahead=True``; ``"random"`` with ``readahead=False``
(LMDB's usual advice for random access to databases larger than RAM). Each pass reads every
payload once after evicting the shard from the page cache (checked with mincore), in stored
order and in uniform shuffled order, one sample at a time (``ds.read_payload``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from packer import open_dataset
from packer.diagnose.measure import evict, tree_files


def cold_pass(path: str, access: str, order: np.ndarray) -> tuple[float, bool]:
    files = tree_files(path)
    residency = evict(files)
    ds = open_dataset(path, access=access)
    t = time.perf_counter()
    for i in order.tolist():
        ds.read_payload(i)
    rate = len(order) / (time.perf_counter() - t)
    ds.close()
    return rate, bool(residency.verified)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = len(open_dataset(args.dataset))
    orders = {"stored order": np.arange(n), "uniform shuffle": np.random.default_rng(0).permutation(n)}
    print(f"{args.dataset}: {n} samples, cold page cache, median of {args.repeats} (min-max)")
    for name, order in orders.items():
        for access in ("sequential", "random"):
            rates, verified = [], True
            for _ in range(args.repeats):
                rate, ok = cold_pass(args.dataset, access, order)
                rates.append(rate)
                verified &= ok
            note = "" if verified else "  (eviction not verified)"
            print(f"  {name:<16} readahead={'on ' if access == 'sequential' else 'off'}  "
                  f"{statistics.median(rates):9,.0f} samples/s ({min(rates):,.0f}-{max(rates):,.0f}){note}")


if __name__ == "__main__":
    main()
