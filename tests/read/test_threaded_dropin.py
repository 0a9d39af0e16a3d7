"""ThreadLoader behaves as a DataLoader where users step: a batch that fails mid-epoch, an epoch left early, the
global RNG, ``batch_size=None``, targets, two iterations at once (a hostile review's findings, session 18)."""

from __future__ import annotations

import shutil
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from support.imagesets import make_imagefolder
from support.stacks import running
from torch.utils.data import DataLoader

import packer
from packer import PackerError, ThreadLoader, convert, open_dataset
from packer.read import threaded


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """26 JPEGs of 30x40 in three classes as memmap, and a copy whose sample 13 lost its JPEG markers."""
    root = tmp_path_factory.mktemp("dropin")
    out = convert(make_imagefolder(root / "src", classes=3, per_class=9, size=(30, 40)), root / "ds.memmap",
                  to="memmap", workers=0, progress=False).output
    bad = shutil.copytree(out, root / "bad.memmap")
    ds = open_dataset(bad)
    offsets = np.load(bad / "shard-00000.offsets.npy")
    with open(bad / "shard-00000.files.bin", "r+b") as fh:  # the JPEG's markers gone, its size kept
        fh.seek(int(offsets[ds.position(13)]))
        fh.write(b"\0" * 16)
    return {"good": out, "bad": bad}


_BEFORE: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _threads_of_others():
    """The threads alive as each test starts (another test's, left for the garbage collector) are not its own."""
    _BEFORE.clear()
    _BEFORE.update(threading.enumerate())


def loader_threads() -> list[threading.Thread]:
    """The test's own ThreadLoader threads still alive."""
    return [t for t in threading.enumerate()
            if t not in _BEFORE and t.name.startswith(("packer-decode", "packer-ThreadLoader"))]


def outcomes(it) -> list:
    """Each batch's labels, or the sample its error names, until the iterator ends."""
    seen = []
    while True:
        try:
            _, labels = next(it)
            seen.append(labels.tolist())
        except StopIteration:
            return seen
        except PackerError as exc:
            seen.append([k for k in range(26) if f"sample {k} " in str(exc) or f"sample {k}:" in str(exc)])


def test_a_batch_that_fails_is_raised_in_its_turn_and_the_epoch_goes_on(packed):
    ds = open_dataset(packed["bad"], image="tensor")
    want = outcomes(iter(DataLoader(ds, batch_size=4, collate_fn=packer.collate)))
    assert want[3] == [13] and len(want) == 7  # the batch holding sample 13 fails; the others come
    for threads in (1, 2):
        it = iter(ThreadLoader(ds, batch_size=4, num_threads=threads))
        assert outcomes(it) == want
    del it
    assert loader_threads() == []


def test_an_error_leaving_the_for_loop_stops_the_threads(packed):
    """The error's traceback does not keep the iteration (nor its threads) alive once the loop is left."""
    with pytest.raises(PackerError) as err:
        for _ in ThreadLoader(open_dataset(packed["bad"], image="tensor"), batch_size=4, num_threads=2):
            pass
    assert "sample 13" in str(err.value) and loader_threads() == []


def test_an_epoch_left_early_gives_back_the_crops_it_drew_ahead(packed):
    """The feeder draws a batch's crops when it reads the batch, batches ahead of the one handed out; leaving an
    epoch early (break, next(iter(...))) gives those draws back, so every later crop is a worker-less DataLoader's
    under torch.manual_seed."""

    def run(make) -> list:
        torch.manual_seed(0)
        loader = make(open_dataset(packed["good"], image="tensor", crop=packer.RandomResizedCropDecode(12)))
        got = []
        for k, batch in enumerate(loader):
            got.append(batch)
            if k == 1:
                break
        got.append(next(iter(loader)))
        return got + list(loader) + list(loader)

    want = run(lambda ds: DataLoader(ds, batch_size=5, shuffle=True))
    for threads in (1, 2):
        got = run(lambda ds, n=threads: ThreadLoader(ds, batch_size=5, shuffle=True, num_threads=n))
        assert len(got) == len(want)
        for (images, labels), (ref, ref_labels) in zip(got, want, strict=True):
            assert torch.equal(labels, ref_labels) and torch.equal(images, ref)


def test_the_shuffle_seed_is_drawn_when_the_iterator_is_made(packed):
    """As DataLoader's: iter() draws from the global RNG at once, so what the program draws next is the same."""
    ds = open_dataset(packed["good"], image="tensor")

    def drawn_after_iter(loader) -> tuple[torch.Tensor, list]:
        torch.manual_seed(0)
        it = iter(loader)
        after = torch.randn(3)
        return after, next(it)[1].tolist()

    want = drawn_after_iter(DataLoader(ds, batch_size=4, shuffle=True, collate_fn=packer.collate))
    got = drawn_after_iter(ThreadLoader(ds, batch_size=4, shuffle=True))
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


@pytest.mark.parametrize("crop", [None, packer.CenterCropDecode(12, resize=14)])
def test_batch_size_none_hands_out_samples_as_the_dataloader_does(packed, crop):
    ds = open_dataset(packed["good"], image="tensor", crop=crop)
    want = list(DataLoader(ds, batch_size=None))
    loader = ThreadLoader(ds, batch_size=None, num_threads=2)
    assert (len(loader), loader.batch_size, loader.batch_sampler, loader.drop_last) == (len(ds), None, None, False)
    got = list(loader)
    assert len(got) == len(want)
    for (image, label), (ref, ref_label) in zip(got, want, strict=True):
        assert torch.equal(image, ref) and type(label) is type(ref_label) and label == ref_label
    with pytest.raises(PackerError, match="drop_last"):
        ThreadLoader(ds, batch_size=None, drop_last=True)


def test_batch_size_and_drop_last_are_there_as_on_a_dataloader(packed):
    ds = open_dataset(packed["good"], image="tensor")
    for kwargs in ({"batch_size": 4, "drop_last": True}, {"batch_size": 3}, {"batch_sampler": [[0, 1], [2]]}):
        loader, ref = ThreadLoader(ds, **kwargs), DataLoader(ds, **kwargs)
        assert (loader.batch_size, loader.drop_last, len(loader)) == (ref.batch_size, ref.drop_last, len(ref))


def test_targets_come_as_the_dataloader_collates_them(packed):
    """Batches stacked in the loader's own memory collate their targets as packer.collate does (strings: a
    tuple), and the images and labels equal a DataLoader's."""
    ds = open_dataset(packed["good"], image="tensor", crop=packer.CenterCropDecode(12, resize=14),
                      target_transform=lambda t: f"class {t}")
    want = list(DataLoader(ds, batch_size=4, collate_fn=packer.collate))
    got = list(ThreadLoader(ds, batch_size=4, num_threads=2))
    for (images, targets), (ref, ref_targets) in zip(got, want, strict=True):
        assert type(targets) is type(ref_targets) is tuple and targets == ref_targets
        assert torch.equal(images, ref)


def test_a_second_iteration_while_one_runs_is_warned_about(packed):
    loader = ThreadLoader(open_dataset(packed["good"], image="tensor"), batch_size=4)
    first = iter(loader)
    next(first)
    with pytest.warns(RuntimeWarning, match="another is still running"):
        second = iter(loader)
    assert len(list(second)) == len(loader) and len(list(first)) == len(loader) - 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(loader)  # the others have ended: no warning
    del first, second
    assert loader_threads() == []


def test_a_background_loader_over_a_plain_threadloader_iterates_and_says_why_it_cannot_save(packed):
    ds = open_dataset(packed["good"], image="tensor")
    background = packer.BackgroundLoader(ThreadLoader(ds, batch_size=4))
    assert len(list(background)) == 7
    with pytest.raises(PackerError, match="cannot save its position"):
        background.state_dict()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("crop", [None, packer.CenterCropDecode(12, resize=14)])
def test_pin_memory_pins_every_tensor_as_a_dataloader_does(packed, crop):
    ds = open_dataset(packed["good"], image="tensor", crop=crop)
    for images, labels in ThreadLoader(ds, batch_size=4, pin_memory=True):
        assert labels.is_pinned()
        assert all(img.is_pinned() for img in (images if isinstance(images, list) else [images]))


def _wait_for(condition) -> None:
    deadline = time.monotonic() + 60  # a bound against a hang, not a timing
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


class Watchdog:
    """A thread that closes a loader, started from inside the loop's own work (a sampler's draw, a sample's
    decoding) so that the close comes exactly there, not after a delay that a loaded machine stretches."""

    def __init__(self) -> None:
        self.loader: ThreadLoader | None = None
        self.epoch: Any = None  # the iteration (threaded._Epoch)
        self.consumer = threading.current_thread()  # the loop's thread
        self.closed: list = []  # what close() returned
        self.thread = threading.Thread(target=lambda: self.closed.append(self.loader and self.loader.close()))

    def watch(self, loader: ThreadLoader):
        """``loader``'s iteration, which ``close_now`` will close; the caller's thread is the loop's."""
        self.loader, self.epoch, self.consumer = loader, iter(loader), threading.current_thread()
        return self.epoch

    def close_now(self, *inside) -> None:
        """Start the close, and return once it is under way: the epoch marked done, and the close inside each of
        ``inside`` (functions on its thread's stack)."""
        self.thread.start()
        _wait_for(lambda: self.epoch.done and running(self.thread, *inside))

    def on_call(self, n: int):
        """A transform that, transforming its ``n``-th sample (counted from 1), waits for the loop to wait on its
        batch, closes the loader and goes on once the close waits for the decode threads (the work not started
        cancelled)."""
        calls = iter(range(1, 1 << 30))

        def transform(target):
            if next(calls) == n:
                _wait_for(lambda: running(self.consumer, threaded._Batch.result))
                self.close_now(ThreadPoolExecutor.shutdown, threading.Thread.join)
            return target
        return transform


class ClosingSampler:
    """Indices in order; before index ``at``, ``watchdog`` closes the loader: the feeder (and the loop waiting on
    it) is busy then."""

    def __init__(self, n: int, at: int, watchdog: Watchdog) -> None:
        self.n, self.at, self.watchdog = n, at, watchdog

    def __iter__(self):
        for i in range(self.n):
            if i == self.at:
                self.watchdog.close_now()
            yield i

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("waiting_on", ["feeder", "decoding"])
def test_close_from_another_thread_ends_the_loop_cleanly(packed, waiting_on):
    """A watchdog calling loader.close() while the loop waits (on the feeder, or on a batch's decoding): the loop
    ends as if the epoch were over, no error (it was "generator already executing", or CancelledError)."""
    slow = waiting_on == "decoding"
    watchdog = Watchdog()
    ds = open_dataset(packed["good"], image="tensor", target_transform=watchdog.on_call(5) if slow else None)
    loader = ThreadLoader(ds, batch_size=2, num_threads=1, prefetch_batches=1,
                          sampler=None if slow else ClosingSampler(len(ds), 5, watchdog))
    got = sum(1 for _ in watchdog.watch(loader))
    watchdog.thread.join(60)
    assert watchdog.closed == [None] and got < len(loader)
    assert loader_threads() == []


def test_an_epoch_collected_in_its_own_decode_thread_closes_without_error(packed):
    """A reference cycle holding an iteration, collected by a GC pass that runs in one of its decode threads: no
    thread joins itself ("cannot join current thread" was printed, and the crops were not given back)."""
    import gc
    import sys

    raised: list = []
    collect = {"now": False}

    def in_decode_thread(target):
        if collect["now"] and threading.current_thread().name.startswith("packer-decode"):
            collect["now"] = False
            gc.collect()
        return target

    ds = open_dataset(packed["good"], image="tensor", target_transform=in_decode_thread)
    hook, sys.unraisablehook = sys.unraisablehook, raised.append
    gc.disable()
    try:
        holder: dict = {}
        holder["self"], holder["it"] = holder, iter(ThreadLoader(ds, batch_size=4, num_threads=2))
        next(holder["it"])
        del holder
        collect["now"] = True
        list(ThreadLoader(ds, batch_size=4, num_threads=2))  # its decode threads run the collection
        deadline = time.monotonic() + 30
        while loader_threads() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        gc.enable()
        sys.unraisablehook = hook
    assert not collect["now"] and raised == [] and loader_threads() == []


EXIT = """
import sys
import packer
ds = packer.open_dataset(sys.argv[1], image="tensor")
kept = iter(packer.ThreadLoader(ds, batch_size=4))
next(kept)
cycle = {}
cycle["self"], cycle["it"] = cycle, iter(packer.BackgroundLoader(packer.ThreadLoader(ds, batch_size=4)))
next(cycle["it"])
print("exiting")
"""


def test_exiting_with_live_iterations_is_quiet(packed):
    """Live iterations at exit are stopped before the modules they need are torn down (it printed "Exception
    ignored ... 'NoneType' object has no attribute 'Empty'")."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", EXIT, str(packed["good"])], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout == "exiting\n" and res.stderr == "", res.stderr


def test_a_batch_cancelled_by_close_is_not_counted_as_handed_out(packed):
    """close() from a watchdog while the first batch decodes: the loop ends, and the saved position is still the
    epoch's start (it had counted the batch it never handed out: a resumed job would skip it)."""
    watchdog = Watchdog()
    ds = open_dataset(packed["good"], image="tensor", target_transform=watchdog.on_call(1))
    sampler = packer.BlockShuffleSampler(ds, batch_size=2, seed=0)
    loader = ThreadLoader(ds, batch_size=2, sampler=sampler, num_threads=1, prefetch_batches=1)
    start = loader.state_dict()
    assert sum(1 for _ in watchdog.watch(loader)) == 0
    watchdog.thread.join(60)
    assert loader.state_dict() == start and loader_threads() == []


def test_close_racing_the_first_next_stops_what_it_starts(packed, monkeypatch):
    """close() while the first next() is starting the threads: the threads it started stop too."""
    real = threaded.ThreadPoolExecutor
    watchdog = Watchdog()

    def closed_while_starting(*args, **kwargs):
        watchdog.thread.start()  # the close comes now, and waits for the start to finish
        _wait_for(lambda: running(watchdog.thread, threaded._Epoch.close))
        return real(*args, **kwargs)

    monkeypatch.setattr(threaded, "ThreadPoolExecutor", closed_while_starting)
    loader = ThreadLoader(open_dataset(packed["good"], image="tensor"), batch_size=2)
    assert sum(1 for _ in watchdog.watch(loader)) <= 1
    watchdog.thread.join(60)
    assert watchdog.closed == [None]
    assert loader_threads() == []


STALLED = """
import sys, time
import packer

def stalled():
    yield 0
    time.sleep(3600)  # a stream that stopped sending
    yield 1

it = iter(packer.BackgroundLoader(stalled(), depth=1, join_timeout=3600))
print(next(it))
"""


def test_exit_does_not_wait_long_for_a_stalled_loader():
    """An iteration kept referenced at exit over a loader that stalls: the interpreter waits a second for it, not
    the ``join_timeout`` a training-time close waits (an hour here: waited for, the run is stopped at 120 s)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", STALLED], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout == "0\n", res.stderr


def test_a_prefetcher_ends_every_waiting_consumer_and_stops_when_dropped():
    import queue

    from packer.read.loaders import Prefetcher

    consumers: list[threading.Thread] = []

    def failing():
        _wait_for(lambda: len(consumers) == 2 and all(running(c, Prefetcher.get, queue.Queue.get) for c in consumers))
        raise ValueError("source broke")  # both consumers wait now
        yield  # a generator

    feed = Prefetcher(failing(), depth=1)
    outcomes: list = []

    def consume():
        try:
            feed.get()
        except BaseException as exc:  # noqa: BLE001 - recorded
            outcomes.append(type(exc).__name__)

    consumers += [threading.Thread(target=consume) for _ in range(2)]
    for c in consumers:
        c.start()
    for c in consumers:
        c.join(10)
    assert sorted(outcomes) == ["StopIteration", "ValueError"]
    endless = Prefetcher(iter(range(10**9)), depth=2, name="packer-ThreadLoader")  # dropped without close()
    del endless
    assert loader_threads() == []
