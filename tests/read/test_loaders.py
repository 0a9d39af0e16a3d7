"""BackgroundLoader and CUDAPrefetcher: order kept, errors re-raised, no thread left behind."""

from __future__ import annotations

import collections
import gc
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from packer.read.loaders import BackgroundLoader, CUDAPrefetcher, map_tensors

_BEFORE: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_of_others():
    """The threads alive as each test starts (another test's, left for the garbage collector) are not its own."""
    _BEFORE.clear()
    _BEFORE.update(threading.enumerate())


def bg_threads() -> list[threading.Thread]:
    """The test's own BackgroundLoader threads still alive."""
    return [t for t in threading.enumerate() if t not in _BEFORE and t.name == "packer-BackgroundLoader"]


def gen(n: int, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise ValueError(f"bad batch {i}")
        yield torch.full((2,), i)


def test_background_loader_yields_everything_in_order():
    bg = BackgroundLoader(range(50), depth=3)
    assert list(bg) == list(range(50))
    assert list(bg) == list(range(50))  # iterable again
    assert bg_threads() == []


def test_background_loader_over_a_dataloader_with_workers():
    ds = TensorDataset(torch.arange(40))
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    got = torch.cat([b[0] for b in BackgroundLoader(loader, depth=2)])
    assert got.tolist() == list(range(40))
    assert bg_threads() == []


def test_no_thread_left_after_break():
    for _ in range(3):
        for i, _b in enumerate(BackgroundLoader(gen(1000), depth=2)):
            if i == 5:
                break
    gc.collect()
    assert bg_threads() == []


def test_loader_exception_is_raised_in_consumer_and_thread_ends():
    seen = []
    with pytest.raises(ValueError, match="bad batch 7"):
        for b in BackgroundLoader(gen(20, fail_at=7)):
            seen.append(int(b[0]))
    assert seen == list(range(7))
    assert bg_threads() == []


def test_no_thread_left_after_consumer_exception():
    with pytest.raises(RuntimeError, match="step failed"):
        for i, _b in enumerate(BackgroundLoader(gen(1000), depth=4)):
            if i == 3:
                raise RuntimeError("step failed")
    gc.collect()
    assert bg_threads() == []


def test_close_stops_live_iterations():
    bg = BackgroundLoader(gen(1000), depth=2)
    it = iter(bg)
    next(it)
    assert len(bg_threads()) == 1
    bg.close()
    assert bg_threads() == []
    with pytest.raises(StopIteration):
        next(it)


def test_depth_must_be_positive():
    with pytest.raises(ValueError):
        BackgroundLoader([], depth=0)


Pair = collections.namedtuple("Pair", "x y")


def test_map_tensors_keeps_structure():
    batch = {"a": [torch.ones(2), (torch.zeros(1), "label")], "b": Pair(torch.ones(1), 3)}
    out = map_tensors(batch, lambda t: t + 1)
    assert out["a"][0].tolist() == [2, 2] and out["a"][1][0].tolist() == [1] and out["a"][1][1] == "label"
    assert isinstance(out["b"], Pair) and out["b"].x.tolist() == [2] and out["b"].y == 3
    assert isinstance(out["a"][1], tuple)


def test_cuda_prefetcher_is_a_pass_through_on_cpu():
    ds = TensorDataset(torch.arange(12).float(), torch.arange(12))
    loader = DataLoader(ds, batch_size=4)
    pf = CUDAPrefetcher(loader, device="cpu")
    assert not pf.active and len(pf) == 3
    got = list(pf)
    assert [b[1].tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_prefetcher_copies_ahead_on_gpu():
    ds = TensorDataset(torch.arange(4096).float().reshape(64, 64), torch.arange(64))
    for pin in (False, True):
        loader = DataLoader(ds, batch_size=8, pin_memory=pin)
        pf = CUDAPrefetcher(loader, "cuda")
        assert pf.active
        out = []
        for x, y in pf:
            assert x.is_cuda and y.is_cuda
            out.append((x * 2).sum().item())  # compute on the default stream right away
        ref = [(x * 2).sum().item() for x, _ in DataLoader(ds, batch_size=8)]
        assert out == ref
