"""Shuffle quality of the block sampler next to a uniform shuffle, as a Markdown table.

Only the order matters here, not the bytes, so by default it uses ImageNet-1k-like metadata
(1,000 classes of 1,281 images, class-sorted like ImageFolder, payload sizes log-normal around
110 KB, 1 GB shards) and, for ``--order shuffled``, the same seeded permutation ``packer
convert`` applies. ``--dataset PATH`` uses a real packed dataset's metadata instead.

    python examples/shuffle_quality.py                       # ImageNet-1k-like, both orders
    python examples/shuffle_quality.py --dataset imgs.lmdb   # a real dataset, as stored
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packer.diagnose.shuffle_quality import batchmates_again, shuffle_stats  # noqa: E402
from packer.read.sampler import (  # noqa: E402
    DEFAULT_BLOCK_BYTES,
    DEFAULT_OPEN_BLOCKS,
    DEFAULT_RUN,
    block_boundaries,
    rank_order,
    stable_permutation,
)

COLUMNS = [
    ("blocks_per_batch", "blocks / batch", "{:.1f}"),
    ("runs_per_batch", "reads / batch", "{:.1f}"),
    ("gap_median", "median gap", "{:,.0f}"),
    ("gap_le_block", "gaps < 1 block", "{:.0%}"),
    ("gap_mean_frac", "mean gap / N", "{:.3f}"),
    ("classes_per_batch", "classes / batch", "{:.1f}"),
    ("label_tv", "label TV", "{:.3f}"),
    ("again", "batch-mates again", "{:.2%}"),
]


def imagenet_like(classes: int, per_class: int, mean_kb: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = classes * per_class
    labels = np.repeat(np.arange(classes), per_class)
    sigma = 0.5
    nbytes = rng.lognormal(np.log(mean_kb * 1000) - sigma**2 / 2, sigma, n).astype(np.int64)
    per_shard = int(1e9 // (mean_kb * 1000))
    return labels, nbytes, list(range(per_shard, n, per_shard))


def rows_for(name, labels, nbytes, cuts, batch, block_bytes, configs, epochs):
    bounds = block_boundaries(nbytes, block_bytes, cuts)
    out = []
    for k, run in configs:
        orders = [rank_order(bounds, e, 0, open_blocks=k, run=run, batch_size=batch) for e in range(epochs + 1)]
        stats = [shuffle_stats(o, labels, batch, bounds) for o in orders[:epochs]]
        for e, st in enumerate(stats):
            st["again"] = batchmates_again(orders[e], orders[e + 1], batch)
        means = {c: float(np.mean([s[c] for s in stats])) for c, _, _ in COLUMNS}
        out.append((f"block, {name}, {k} open, run {run}", means))
    return out, bounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", help="a packed dataset: use its labels, sizes and shards as stored")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--per-class", type=int, default=1281)
    ap.add_argument("--mean-kb", type=float, default=110.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--block-mb", type=float, default=DEFAULT_BLOCK_BYTES / 1e6)
    ap.add_argument("--configs", default="8:1,1:16,8:16,32:16,8:64",
                    help="open_blocks:run pairs to compare, comma-separated")
    ap.add_argument("--epochs", type=int, default=2, help="epochs averaged per row")
    args = ap.parse_args()
    block = int(args.block_mb * 1e6)
    ks = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]

    rows = []
    if args.dataset:
        from packer import open_dataset

        ds = open_dataset(args.dataset)
        labels, nbytes = ds.index.labels, ds.index.nbytes
        cuts = np.cumsum([s.num_samples for s in ds.manifest.shards])[:-1].tolist()
        order_name = f"--order {ds.manifest.options.get('order', 'source')}"
        r, bounds = rows_for(order_name, labels, nbytes, cuts, args.batch, block, ks, args.epochs)
        rows += r
        what = f"{args.dataset}: {len(labels):,} samples"
    else:
        labels, nbytes, cuts = imagenet_like(args.classes, args.per_class, args.mean_kb)
        r, bounds = rows_for("--order source", labels, nbytes, cuts, args.batch, block,
                             [(DEFAULT_OPEN_BLOCKS, DEFAULT_RUN)], args.epochs)
        rows += r
        perm = stable_permutation(len(labels), 0)  # what `packer convert --order shuffled --seed 0` does
        labels, nbytes = labels[perm], nbytes[perm]
        r, bounds = rows_for("--order shuffled", labels, nbytes, cuts, args.batch, block, ks, args.epochs)
        rows += r
        what = (f"class-sorted metadata: {args.classes} classes x {args.per_class} images, "
                f"~{args.mean_kb:.0f} KB each")
    rng = np.random.default_rng(0)
    uorders = [rng.permutation(len(labels)) for _ in range(args.epochs + 1)]
    uni = [shuffle_stats(o, labels, args.batch, bounds) for o in uorders[:-1]]
    for e, st in enumerate(uni):
        st["again"] = batchmates_again(uorders[e], uorders[e + 1], args.batch)
    rows.insert(0, ("uniform shuffle", {c: float(np.mean([s[c] for s in uni])) for c, _, _ in COLUMNS}))

    sizes = np.diff(bounds)
    print(f"{what}; batch {args.batch}; blocks of {args.block_mb:g} MB "
          f"({len(sizes):,} blocks, {sizes.mean():.0f} samples each on average); mean of {args.epochs} epochs\n")
    print("- blocks / batch: distinct blocks a batch touches; reads / batch: its runs of contiguous samples")
    print("- gap: |position difference| of consecutive samples (median, in samples; mean, as a fraction of N)")
    print("- label TV: total-variation distance of a batch's label histogram from the dataset's")
    print("- batch-mates again: share of the pairs batched together in one epoch that meet again in the next\n")
    print("| order | " + " | ".join(h for _, h, _ in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for name, st in rows:
        print(f"| {name} | " + " | ".join(f.format(st[c]) for c, _, f in COLUMNS) + " |")


if __name__ == "__main__":
    main()
