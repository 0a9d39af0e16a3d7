"""Bytes fetched per payload byte delivered when a dataset of small payloads is read by URL in ranged mode
(packer/read/ranged.py): lmdb keeps values under about 2 KB inside its leaf pages, so the payloads' order in the file
is not their storage order. Counted at the emulated store (packer/storage/emulate.py, in this process, no latency:
only bytes and GETs are measured, never time).

    python examples/measure_small_ranges.py [--count 2000] [--formats lmdb memmap] [--block-bytes 65536]

Tiny PNGs of random pixels (about 0.4-1.8 KB each) in two class folders, converted by ``packer.convert``; one epoch
of ``BlockShuffleSampler`` order read through a ``DataLoader`` (no workers) from a cold node cache as large as the
dataset. Figures go to docs/remote.md with this command.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import DataLoader

import packer
from packer.read.ranged import RangedSource
from packer.storage.emulate import EmulatedStore

CREDENTIALS = {"aws_access_key_id": "id", "aws_secret_access_key": "key", "region": "us-east-1"}


def tiny_pngs(root: Path, count: int, seed: int = 0) -> int:
    """``count`` PNGs of random pixels, 8-24 pixels a side, under ``root/c0`` and ``root/c1``; their bytes."""
    rng = np.random.default_rng(seed)
    total = 0
    for k in range(count):
        h, w = (int(v) for v in rng.integers(8, 25, size=2))
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
        path = root / f"c{k % 2}" / f"{k:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
        total += len(buf.getvalue())
    return total


def epoch(root: Path, name: str, cache: Path, block_bytes: int, batch_size: int) -> dict:
    """One cold epoch of ``s3://bucket/<name>`` in ranged mode: what the store sent against what was delivered."""
    with EmulatedStore(root, "bucket") as store:
        with packer.open_dataset(f"s3://bucket/{name}", cache_dir=cache, cache_limit="1GB", remote_mode="ranged",
                                 storage_options={**CREDENTIALS, "endpoint": store.endpoint}) as ds:
            opened = store.stats.settled()
            sampler = packer.BlockShuffleSampler(ds, batch_size=batch_size, block_bytes=block_bytes, seed=0)
            loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=0, collate_fn=packer.collate)
            samples = sum(len(labels) for _, labels in loader)
            done = store.stats.settled()
            source = ds.source
            assert isinstance(source, RangedSource)
            delivered = int(source.index.nbytes.sum())
            fetched = int(done["body_bytes"] - opened["body_bytes"])
            groups = source.groups
            return {"dataset": name, "samples": samples, "payload_bytes": delivered, "fetched_bytes": fetched,
                    "fetched_per_delivered": round(fetched / delivered, 3), "gets": int(done["gets"] - opened["gets"]),
                    "groups": len(groups), "mean_group_bytes": round(float(np.mean(groups.end - groups.start)), 1),
                    "shard_bytes": sum(f.num_bytes for s in ds.manifest.shards for f in s.files)}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--formats", nargs="+", default=["lmdb"])
    parser.add_argument("--block-bytes", type=int, default=64 << 10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--shard-bytes", type=int, default=1 << 20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        total = tiny_pngs(base / "imgs", args.count)
        print(f"{args.count} PNGs, {total / args.count:.0f} bytes each on average")
        for fmt in args.formats:
            packer.convert(base / "imgs", base / "root" / f"ds.{fmt}", to=fmt, shard_bytes=args.shard_bytes,
                           progress=False, workers=0)
            row = epoch(base / "root", f"ds.{fmt}", base / f"cache-{fmt}", args.block_bytes, args.batch_size)
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
