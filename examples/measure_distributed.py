"""Conversion rate on a local Dask cluster (1 and 2 workers) vs packer's plain process pool.

Every configuration converts the same folder with the same options (so the same shards: the
output is checked to be byte-identical across them); each figure is the median of
``--repeats`` runs, interleaved so load drifts hit all alike. Cluster start-up is not timed
(a cluster is started once per worker count and its workers are warmed up first); the time is
``convert``'s own: scan, plan, shards, index and manifest.

    python examples/measure_distributed.py demo/imgs --dask-workers 1,2 --pool-workers 2 --repeats 3

The shard size matters: a Dask run converts one shard per task, so the set needs at least as
many shards as workers (default 16 MB: 2,000 sample images give about 13 shards).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from packer import convert
from packer.units import parse_bytes
from packer.write.cluster import open_client


def _warm_up() -> None:
    import packer.write.convert  # noqa: F401  (the first task of a fresh worker would pay for these imports)


def run(src: Path, shard_bytes: int, validate: str, workers: int, client=None) -> tuple[float, list[list[str]]]:
    """One conversion: (files/s, each shard's files' checksums)."""
    tmp = Path(tempfile.mkdtemp(dir=src.parent, prefix=".measure-"))
    try:
        res = convert(src, tmp / "o.lmdb", shard_bytes=shard_bytes, validate=validate, workers=workers,
                      progress=False, client=client)
        manifest = json.loads((tmp / "o.lmdb" / "manifest.json").read_text())
        return (res.num_samples + len(res.errors)) / res.seconds, [[f["sha256"] for f in s["files"]]
                                                                   for s in manifest["shards"]]
    finally:
        shutil.rmtree(tmp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", type=Path)
    ap.add_argument("--dask-workers", default="1,2", help="local Dask worker processes to try (1 thread each)")
    ap.add_argument("--pool-workers", type=int, default=2, help="processes of the plain (local) conversion")
    ap.add_argument("--shard-size", type=parse_bytes, default=16_000_000)
    ap.add_argument("--validate", choices=("full", "header", "none"), default="full")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    counts = [int(n) for n in args.dask_workers.split(",") if n]

    with contextlib.ExitStack() as stack:
        clients = {n: stack.enter_context(open_client(f"local:{n}")) for n in counts}
        for c in clients.values():
            c.run(_warm_up)
        configs = {f"process pool, {args.pool_workers} workers": None,
                   **{f"Dask LocalCluster, {n} worker{'s' * (n > 1)}": c for n, c in clients.items()}}
        rates: dict[str, list[float]] = {k: [] for k in configs}
        digests: set[tuple[tuple[str, ...], ...]] = set()
        for _ in range(args.repeats):
            for name, client in configs.items():
                rate, shards = run(args.source, args.shard_size, args.validate, args.pool_workers, client)
                rates[name].append(rate)
                digests.add(tuple(map(tuple, shards)))
    base = statistics.median(rates[next(iter(configs))])
    print(f"{args.source}: --validate {args.validate}, --shard-size {args.shard_size / 1e6:.0f} MB, "
          f"{len(shards)} shards, median of {args.repeats}; outputs byte-identical: {len(digests) == 1}")
    print("| conversion | files/s | min-max | vs process pool |")
    print("|---|---:|---:|---:|")
    for name, v in rates.items():
        med = statistics.median(v)
        print(f"| {name} | {med:.0f} | {min(v):.0f}-{max(v):.0f} | {med / base:.2f}x |")
    if len(digests) != 1:
        raise SystemExit("outputs differ between configurations: a bug")


if __name__ == "__main__":
    main()
