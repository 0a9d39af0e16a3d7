"""Two real processes under Lightning DDP, torchrun and accelerate: every sample once per epoch, block order kept."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
from support import ddp_jobs
from support.imagesets import make_imagefolder

from packer import BlockShuffleSampler, PackerError, convert, open_dataset
from packer.read.sampler import BlockBatchSampler

JOB = Path(ddp_jobs.__file__)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    src = make_imagefolder(root / "imgs", classes=5, per_class=13)  # 65 samples: odd, so ranks pad
    total = sum(p.stat().st_size for p in src.rglob("*.jpg"))
    out = convert(src, root / "ds.lmdb", progress=False, workers=0, shard_bytes=total // 2 + 1).output
    ds = open_dataset(out, image="numpy")
    block = int(8 * ds.index.nbytes.mean())  # about 8 samples a block
    return {"path": out, "ds": ds, "block": block}


def run_job(cmd: list[str], tmp_path: Path) -> Path:
    out = tmp_path / "seen"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([*cmd, str(out)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def torchrun(kind: str, packed: dict) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(JOB), kind,
            str(packed["path"])]


def seen(out: Path, name: str, epoch: int) -> list[list[int]]:
    return [json.loads((out / f"{name}-rank{r}-epoch{epoch}.json").read_text()) for r in (0, 1)]


def same_block_fraction(order: list[int], bounds: np.ndarray) -> float:
    """Locality: the fraction of consecutive samples that lie in the same block."""
    blk = np.searchsorted(bounds, np.asarray(order), side="right")
    return float(np.mean(blk[1:] == blk[:-1]))


def check_every_sample_once(out: Path, name: str, n: int) -> list[list[list[int]]]:
    """Each epoch: equal counts per rank, every sample, repeats only DistributedSampler's padding."""
    epochs = [seen(out, name, e) for e in range(ddp_jobs.EPOCHS)]
    for r0, r1 in epochs:
        assert len(r0) == len(r1) == math.ceil(n / 2)
        c = Counter(r0 + r1)
        assert set(c) == set(range(n)) and sum(c.values()) - n == 2 * math.ceil(n / 2) - n
    assert epochs[0] != epochs[1]  # set_epoch reached the sampler
    return epochs


def check_block_order(epochs, packed: dict) -> None:
    """Each rank read exactly the bare sampler's order for its rank: nothing re-split or re-shuffled."""
    ds, n = packed["ds"], len(packed["ds"])
    for epoch, ranks in enumerate(epochs):
        for rank, got in enumerate(ranks):
            bare = BlockShuffleSampler(ds, block_bytes=packed["block"], batch_size=ddp_jobs.BATCH, seed=ddp_jobs.SEED,
                                       num_replicas=2, rank=rank)
            assert got == bare.order(epoch).tolist()
            uniform = np.random.default_rng(epoch).permutation(n)[: len(got)].tolist()
            stored = packed["ds"].positions(got).tolist()  # blocks are runs of storage positions
            assert same_block_fraction(stored, bare.bounds) > same_block_fraction(uniform, bare.bounds) + 0.3


@pytest.mark.slow
def test_lightning_ddp_default_trainer_keeps_the_block_sampler(packed, tmp_path):
    pytest.importorskip("lightning")
    out = run_job([sys.executable, str(JOB), "lightning", str(packed["path"]), str(packed["block"])], tmp_path)
    check_block_order(check_every_sample_once(out, "lightning-block", len(packed["ds"])), packed)


def test_torchrun_block_and_distributed_sampler(packed, tmp_path):
    out = run_job([*torchrun("torchrun", packed), str(packed["block"])], tmp_path)
    check_block_order(check_every_sample_once(out, "torchrun-block", len(packed["ds"])), packed)
    check_every_sample_once(out, "torchrun-distributed", len(packed["ds"]))


def test_accelerate_with_the_whole_order_per_process(packed, tmp_path):
    pytest.importorskip("accelerate")
    out = run_job([*torchrun("accelerate", packed), str(packed["block"])], tmp_path)
    ds, n, b = packed["ds"], len(packed["ds"]), ddp_jobs.BATCH
    for epoch in range(ddp_jobs.EPOCHS):
        r0, r1 = seen(out, "accelerate-block", epoch)
        assert set(r0 + r1) == set(range(n)) and len(r0) == len(r1) and len(r0 + r1) - n < 2 * b
        whole = BlockShuffleSampler(ds, block_bytes=packed["block"], batch_size=b, seed=ddp_jobs.SEED,
                                    num_replicas=1, rank=0).order(epoch).tolist()
        batches = [whole[i : i + b] for i in range(0, n, b)]
        assert r0[: 4 * b] == [i for bt in batches[0:8:2] for i in bt]  # accelerate deals whole batches in turn
        assert r1[: 4 * b] == [i for bt in batches[1:8:2] for i in bt]
    assert seen(out, "accelerate-block", 0) != seen(out, "accelerate-block", 1)
    # a sampler left to split the ranks itself says that accelerate will split them again
    for r in (0, 1):
        caught = json.loads((out / f"accelerate-warnings-rank{r}.json").read_text())
        assert any("num_replicas=1, rank=0" in w for w in caught), caught


# ------------------------------------------------------------------ ranks decided when used


def test_ranks_come_from_the_process_group_at_use_not_at_construction(packed, tmp_path):
    ds = packed["ds"]
    s = BlockShuffleSampler(ds, block_bytes=packed["block"], batch_size=8, seed=1)  # no process group yet
    assert (s.num_replicas, s.rank, len(s)) == (1, 0, len(ds))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert (s.num_replicas, s.rank, len(s)) == (1, 0, len(ds))
    finally:
        dist.destroy_process_group()
    explicit = BlockShuffleSampler(ds, block_bytes=packed["block"], num_replicas=2, rank=1)
    assert (explicit.num_replicas, explicit.rank, len(explicit)) == (2, 1, math.ceil(len(ds) / 2))
    assert explicit.num_samples == len(explicit) and explicit.total_size == 2 * len(explicit)
    with pytest.raises(PackerError, match="rank 2 is not in"):
        BlockShuffleSampler(ds, num_replicas=2, rank=2)


def test_lightning_rebuilding_a_block_batch_sampler_is_a_clear_error(packed):
    from torch.utils.data import DistributedSampler

    # what Lightning does to a custom batch_sampler under DDP: cls(its DistributedSampler, batch_size=, drop_last=)
    with pytest.raises(PackerError, match="sampler=BlockShuffleSampler"):
        BlockBatchSampler(DistributedSampler(packed["ds"], num_replicas=2, rank=0), batch_size=8, drop_last=False)
