"""Training from a bucket against the same dataset local: time to the first batch, decoded images/s from the second
batch on, and bytes fetched, for open_dataset(URL) in ranged mode (packer/read/ranged.py) and whole-shard mode
(packer/read/remote.py), one run on the same photos.

    python examples/measure_remote_read.py [--count 2000] [--latency 0.02] [--mbit 1000]
        [--modes local ranged shard local] [--json out.json]

Synthetic photos (packer's generator, 500x375 JPEGs) converted to lmdb in shards of --shard-size; the emulated store
(packer/storage/emulate.py) serves the folder in its own process with --latency seconds before each response and a
link of --mbit Mbit/s. Each reader: DataLoader(num_workers=--workers, BlockShuffleSampler, batch_size=--batch,
collate_fn=packer.collate, image="tensor"), two epochs; each remote one starts with a cold cache (a new cache_dir),
its second epoch reads through a cache as large as the dataset. Bytes fetched: the node downloader's count (whole
files and ranges), per epoch, over the payload bytes the epoch delivers (the index's nbytes). The local folder
was just written (its pages are cached): the local figures are the decode limit of these cores. Figures go to
docs/remote.md with this command.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_storage import Server  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import packer  # noqa: E402
from packer.read.dataset import RemoteMode  # noqa: E402
from packer.tools.sample import make_sample  # noqa: E402
from packer.units import parse_bytes  # noqa: E402


def epoch(loader: DataLoader) -> dict:
    """One pass: seconds to the first batch, images/s from the second batch on."""
    start = time.perf_counter()
    first = None
    count = 0
    for images, _ in loader:
        if first is None:
            first = time.perf_counter()
        else:
            count += len(images)
    end = time.perf_counter()
    assert first is not None
    return {"first_batch_s": round(first - start, 3), "img_per_s": round(count / max(end - first, 1e-9), 1)}


def run(ds, args) -> list[dict]:
    sampler = packer.BlockShuffleSampler(ds, batch_size=args.batch)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        collate_fn=packer.collate, persistent_workers=False)
    return [epoch(loader) for _ in range(2)]


def remote_run(server: Server, cache_dir: Path, mode: str, size: int, delivered: int, args) -> list[dict]:
    """Two epochs of s3://packer/ds.lmdb in ``mode`` from a cold ``cache_dir``, with the bytes each fetched."""
    remote = packer.open_dataset("s3://packer/ds.lmdb", cache_dir=cache_dir, cache_limit=2 * size,
                                 storage_options={"endpoint": server.endpoint, "skip_signature": True,
                                                  "region": "us-east-1"}, image="tensor",
                                 remote_mode=cast(RemoteMode, mode))
    try:
        client = remote.store.files.remote.client  # type: ignore[attr-defined]
        sampler = packer.BlockShuffleSampler(remote, batch_size=args.batch)
        loader = DataLoader(remote, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                            collate_fn=packer.collate, persistent_workers=False)
        out = []
        for n in range(2):
            sampler.set_epoch(n)
            before = client.stats()
            figures = epoch(loader)
            after = client.stats()
            fetched = sum(after[k] - before[k] for k in ("file_bytes", "fetched_bytes"))
            out.append({**figures, "fetched_bytes": fetched, "fetched_per_delivered": round(fetched / delivered, 3)})
        return out
    finally:
        remote.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--shard-size", default="8MB")
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--mbit", type=float, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--modes", nargs="+", default=["local", "ranged", "shard", "local"],
                        choices=["local", "ranged", "shard"])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_sample(Path(tmp) / "imgs", count=args.count, progress=False)
        out = Path(tmp) / "root" / "ds.lmdb"
        packer.convert(Path(tmp) / "imgs", out, to="lmdb", shard_bytes=parse_bytes(args.shard_size), progress=False)
        server = Server("emulate", Path(tmp) / "root", args.latency, args.mbit * 1e6 / 8)
        try:
            local = packer.open_dataset(out, image="tensor")
            size = sum(f.num_bytes for s in local.manifest.shards for f in s.files)
            delivered = int(local.store.index.nbytes.sum())
            results: dict = {"samples": len(local), "shards": len(local.manifest.shards), "dataset_bytes": size,
                             "payload_bytes": delivered,
                             "link": {"latency_s": args.latency, "mbit_s": args.mbit,
                                      "link_img_per_s": round(args.mbit * 1e6 / 8 / (size / len(local)), 1)}}
            for mode in args.modes:  # a mode named twice (local before and after the remote ones) keyed "mode-2"
                key = mode if mode not in results else f"{mode}-2"
                results[key] = run(local, args) if mode == "local" else remote_run(
                    server, Path(tmp) / f"cache-{mode}", mode, size, delivered, args)
        finally:
            server.close()
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
