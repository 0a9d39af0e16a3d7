"""Resuming mid-epoch: samplers and BackgroundLoader save where they are; a resumed epoch neither repeats nor skips."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from support.imagesets import make_imagefolder
from support.stacks import running
from torch.utils.data import DataLoader

from packer import (
    BackgroundLoader,
    BlockBatchSampler,
    BlockShuffleSampler,
    PackerError,
    ThreadLoader,
    convert,
    open_dataset,
)

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader

BATCH = 8


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    src = make_imagefolder(root / "imgs", classes=5, per_class=13)  # 65 samples: a short last batch
    out = convert(src, root / "ds.lmdb", progress=False, workers=0).output
    ds = open_dataset(out, image="numpy")
    return {"path": out, "ds": ds, "block": int(8 * ds.index.nbytes.mean())}


def sampler(packed, **kw):
    return BlockShuffleSampler(packed["ds"], block_bytes=packed["block"], batch_size=BATCH, seed=4, **kw)


def indices(batch) -> list[int]:
    return batch[1].tolist()  # the Indexed-style collate below puts the index second


def collate(items):
    return torch.stack([torch.tensor(int(img.sum())) for img, _ in items]), torch.tensor([i for _, i in items])


class Indexed(torch.utils.data.Dataset):
    """(image, index): the real packed read, with the index to check the order by."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        return self.ds[i][0], i


def loader_for(packed, cls=StatefulDataLoader, workers=0, batch_sampler=False, s=None):
    ds = Indexed(packed["ds"])
    if batch_sampler:
        bs = BlockBatchSampler(packed["ds"], BATCH, block_bytes=packed["block"], seed=4)
        return cls(ds, batch_sampler=bs, num_workers=workers, collate_fn=collate), bs
    s = s or sampler(packed)
    return cls(ds, sampler=s, batch_size=BATCH, num_workers=workers, collate_fn=collate), s


# ------------------------------------------------------------------ the sampler alone


def test_plain_loop_resumes_exactly_json_state(packed):
    s = sampler(packed)
    s.set_epoch(2)
    whole = list(s)
    s.set_epoch(2)  # without it the next pass is epoch 3's
    it = iter(s)
    head = [next(it) for _ in range(21)]
    state = json.loads(json.dumps(s.state_dict()))  # plain ints: any checkpoint format holds it
    assert state["epoch"] == 2 and state["yielded"] == 21
    fresh = sampler(packed)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # the loop calling set_epoch for the saved epoch keeps the position
    assert head + list(fresh) == whole
    fresh.set_epoch(2)
    assert list(fresh) == whole  # the next iteration of that epoch starts at its beginning again


def test_state_across_the_epoch_boundary(packed):
    s = sampler(packed)
    run = []
    for epoch in range(3):
        s.set_epoch(epoch)
        run.append(list(s))
    # killed in epoch 1 after 30 samples
    s = sampler(packed)
    s.set_epoch(1)
    it = iter(s)
    head = [next(it) for _ in range(30)]
    fresh = sampler(packed)
    fresh.load_state_dict(s.state_dict())
    resumed = []
    for epoch in range(fresh.epoch, 3):
        fresh.set_epoch(epoch)
        resumed += list(fresh)
    assert head + resumed == run[1] + run[2]
    # saved at the very end of epoch 0: the next epoch starts whole, chosen by set_epoch or by itself
    end = sampler(packed)
    list(end)
    fresh = sampler(packed)
    fresh.load_state_dict(end.state_dict())
    fresh.set_epoch(0)
    assert list(fresh) == []  # epoch 0 was done
    fresh.set_epoch(1)
    assert list(fresh) == run[1]
    fresh = sampler(packed)
    fresh.load_state_dict(end.state_dict())
    assert list(fresh) == run[1] and list(fresh) == run[2]  # as the run without the interruption goes on


def test_each_pass_without_set_epoch_is_the_next_epoch(packed):
    """A plain loop that never calls set_epoch reshuffles every pass, as shuffle=True does: the orders set_epoch(0),
    (1), (2) give; a loop calling set_epoch keeps choosing (the same epoch twice repeats it)."""
    explicit = sampler(packed)
    want = []
    for epoch in range(3):
        explicit.set_epoch(epoch)
        want.append(list(explicit))
    assert want[0] != want[1] != want[2] and sorted(want[0]) == sorted(want[1])
    plain = sampler(packed)
    assert [list(plain) for _ in range(3)] == want and plain.epoch == 2
    unread, left = iter(plain), iter(plain)  # an iterator nobody reads (DataLoader makes one) is no pass
    [next(left) for _ in range(5)]  # and one left before its end (a break) is started again
    del unread, left
    assert list(plain) == [int(i) for i in plain.order(3)] and list(plain) == [int(i) for i in plain.order(4)]
    explicit.set_epoch(1)
    assert list(explicit) == want[1]
    explicit.set_epoch(1)
    assert list(explicit) == want[1]


def test_ranks_stay_in_step_without_set_epoch(packed):
    """DDP-style ranks each loop over their sampler without set_epoch: every pass, the ranks split the same epoch."""
    ranks = [sampler(packed, num_replicas=2, rank=r) for r in (0, 1)]
    n = len(packed["ds"])
    seen = []
    for epoch in range(3):
        parts = [list(r) for r in ranks]
        assert len(parts[0]) == len(parts[1]) == (n + 1) // 2 and set(parts[0] + parts[1]) == set(range(n))
        assert parts == [[int(i) for i in r.order(epoch)] for r in ranks]
        seen.append(parts)
    assert seen[0] != seen[1] != seen[2]


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_and_threadloader_loops_reshuffle_without_set_epoch(packed, workers):
    """A DataLoader makes two iterators per epoch with workers (it reads one): still one epoch per loop; ThreadLoader
    and StatefulDataLoader the same."""
    loader, s = loader_for(packed, cls=DataLoader, workers=workers)
    got = [[i for b in loader for i in indices(b)] for _ in range(3)]
    assert got == [[int(i) for i in s.order(e)] for e in range(3)]
    labels = packed["ds"].targets
    t = sampler(packed)
    threads = ThreadLoader(packed["ds"], sampler=t, batch_size=BATCH, num_threads=2,
                           collate_fn=lambda items: [label for _, label in items])
    assert [[x for b in threads for x in b] for _ in range(2)] == [[labels[i] for i in got[e]] for e in range(2)]
    stateful, _ = loader_for(packed, workers=workers)
    assert [[i for b in stateful for i in indices(b)] for _ in range(3)] == got


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("where", ["mid-epoch", "end of epoch"])
def test_stateful_dataloader_without_set_epoch_resumes_into_the_same_epochs(packed, workers, where):
    """No set_epoch anywhere: killed in epoch 1 (after 3 batches, or right after its last) and resumed, the run
    goes on exactly as the uninterrupted one (StatefulDataLoader's own resume makes and drops iterators)."""
    whole, _ = loader_for(packed, workers=workers)
    run = [[indices(b) for b in whole] for _ in range(3)]
    assert run[0] != run[1] != run[2]  # each epoch its own order
    first, _ = loader_for(packed, workers=workers)
    assert [indices(b) for b in first] == run[0]
    it = iter(first)
    k = 3 if where == "mid-epoch" else len(run[1])
    head = [indices(next(it)) for _ in range(k)]
    if where == "end of epoch":
        assert next(it, None) is None
    state = first.state_dict()
    del it
    again, _ = loader_for(packed, workers=workers)
    again.load_state_dict(state)
    rest = [indices(b) for b in again] if where == "mid-epoch" else []
    assert head + rest == run[1]
    assert [indices(b) for b in again] == run[2]


def test_a_state_for_another_order_is_refused(packed):
    s = sampler(packed)
    state = s.state_dict()
    with pytest.raises(PackerError, match="seed 4 saved, 5 here"):
        BlockShuffleSampler(packed["ds"], block_bytes=packed["block"], batch_size=BATCH, seed=5).load_state_dict(state)
    with pytest.raises(PackerError, match="num_replicas 1 saved, 2 here"):
        sampler(packed, num_replicas=2, rank=1).load_state_dict(state)
    with pytest.raises(PackerError, match="out of range"):
        s.load_state_dict({**state, "yielded": len(s) + 1})
    with pytest.raises(PackerError, match="not a BlockShuffleSampler state"):
        s.load_state_dict({"yielded": 3})


def test_rank_1_resumes_from_rank_0s_state(packed):
    # Lightning saves rank 0's checkpoint and every rank loads it: positions are equal across ranks
    r0, r1 = sampler(packed, num_replicas=2, rank=0), sampler(packed, num_replicas=2, rank=1)
    it0 = iter(r0)
    [next(it0) for _ in range(16)]
    whole1 = list(r1)
    r1.load_state_dict(r0.state_dict())
    assert list(r1) == whole1[16:]


# ------------------------------------------------------------------ torchdata's StatefulDataLoader


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_sampler", [False, True])
def test_stateful_dataloader_resumes_at_the_next_batch(packed, workers, batch_sampler):
    full, s = loader_for(packed, workers=workers, batch_sampler=batch_sampler)
    s.set_epoch(3)
    whole = [indices(b) for b in full]
    assert sorted(i for b in whole for i in b) == list(range(len(packed["ds"])))
    k = 3
    first, s = loader_for(packed, workers=workers, batch_sampler=batch_sampler)
    s.set_epoch(3)
    it = iter(first)
    head = [indices(next(it)) for _ in range(k)]  # the workers have prefetched batches beyond k
    state = first.state_dict()
    del it
    again, _ = loader_for(packed, workers=workers, batch_sampler=batch_sampler)
    again.load_state_dict(state)  # the epoch comes with the state: no set_epoch needed
    assert head + [indices(b) for b in again] == whole


@pytest.mark.parametrize("workers", [0, 2])
def test_background_loader_saves_the_consumed_position_not_the_prefetched_one(packed, workers):
    full, s = loader_for(packed, workers=workers)
    whole = [indices(b) for b in full]
    inner, s = loader_for(packed, workers=workers)
    bg = BackgroundLoader(inner, depth=4)
    before = set(threading.enumerate())
    it = iter(bg)
    head = [indices(next(it)) for _ in range(2)]
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "packer-BackgroundLoader"]
    deadline = time.monotonic() + 60  # a bound against a hang, not a timing
    while not running(thread, queue.Queue.put, threading.Condition.wait) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert running(thread, queue.Queue.put, threading.Condition.wait)  # its queue full: 4 batches ahead of the consumer
    state = bg.state_dict()
    it.close()
    inner2, _ = loader_for(packed, workers=workers)
    bg2 = BackgroundLoader(inner2, depth=4)
    bg2.load_state_dict(state)
    assert head + [indices(b) for b in bg2] == whole


def test_background_loader_over_a_plain_loader_says_it_cannot_save(packed):
    plain, _ = loader_for(packed, cls=DataLoader)
    with pytest.raises(PackerError, match="StatefulDataLoader"):
        BackgroundLoader(plain).state_dict()


# ------------------------------------------------------------------ a real kill

_JOB = r"""
import os, sys, time
import torch
sys.path.insert(0, sys.argv[3])
import test_sampler_state as t
packed = {"ds": t.open_dataset(sys.argv[1], image="numpy"), "block": int(sys.argv[4])}
out = sys.argv[2]
inner, s = t.loader_for(packed, workers=2)
loader = t.BackgroundLoader(inner, depth=3)  # batches prefetched by the thread and by the workers
checkpoint = os.path.join(out, "state.pt")
state = torch.load(checkpoint) if os.path.exists(checkpoint) else None
if state is None:
    s.set_epoch(2)
else:
    loader.load_state_dict(state["loader"])  # the epoch comes with it
step = 0 if state is None else state["step"]
for batch in loader:
    step += 1
    torch.save(t.indices(batch), os.path.join(out, "tmp"))
    os.replace(os.path.join(out, "tmp"), os.path.join(out, f"batch-{step:03d}.pt"))
    torch.save({"loader": loader.state_dict(), "step": step}, os.path.join(out, "tmp"))
    os.replace(os.path.join(out, "tmp"), checkpoint)  # the checkpoint, after the step
    if state is None and step >= 3:
        time.sleep(600)  # killed here, with batches prefetched by the workers and the thread
"""


def test_sigkilled_job_resumes_at_the_batch_after_its_last_checkpoint(packed, tmp_path):
    full, s = loader_for(packed)
    s.set_epoch(2)
    whole = [indices(b) for b in full]
    job = tmp_path / "job.py"
    job.write_text(_JOB)
    cmd = [sys.executable, str(job), str(packed["path"]), str(tmp_path), str(Path(__file__).parent),
           str(packed["block"])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent), *sys.path]))
    log = tmp_path / "stderr.txt"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, env=env, stderr=err)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (tmp_path / "batch-003.pt").exists():
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, log.read_text()[-3000:]
    assert len(list(tmp_path.glob("batch-*.pt"))) == 3 < len(whole)
    subprocess.run(cmd, env=env, check=True, timeout=120)
    got = [torch.load(p) for p in sorted(tmp_path.glob("batch-*.pt"))]
    assert got == whole and len(got) == len(whole)
