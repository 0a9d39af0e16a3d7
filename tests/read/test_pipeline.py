"""One batch loop: every loader reads through ``BatchPipeline.run`` (the loop once lived in three places, each
arranging its own read-ahead), counted through the pipeline's clock in a real run of each; and the sample source
interface stays small."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from support.imagesets import make_imagefolder
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

import packer
from packer import convert, open_dataset
from packer.diagnose.instrument import clock_of, instrument
from packer.read.cache import RamCache
from packer.read.source import SampleSource
from packer.read.store import ShardStore


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """JPEGs of mixed sizes (lmdb) and raw pixels of one size (memmap, for get_batch and its views)."""
    root = tmp_path_factory.mktemp("pipeline")
    src = make_imagefolder(root / "src", classes=2, per_class=7, size=(30, 40))
    return {"jpeg": convert(src, root / "ds.lmdb", to="lmdb", workers=0, progress=False).output,
            "raw": convert(src, root / "ds.memmap", to="memmap", payload="raw", resize="24x32", workers=0,
                           progress=False).output}


def _dataloader(ds) -> int:
    return sum(len(labels) for _, labels in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=packer.collate))


def _threadloader(ds) -> int:
    return sum(len(labels) for _, labels in packer.ThreadLoader(ds, batch_size=4, num_threads=2))


def _items(ds) -> int:
    return sum(1 for i in range(len(ds)) if ds[i] is not None)


def _get_batch(ds) -> int:
    return sum(len(ds.get_batch(list(range(k, min(k + 4, len(ds)))))[1]) for k in range(0, len(ds), 4))


def _batch_view(ds) -> int:
    batches = BatchSampler(SequentialSampler(range(len(ds))), batch_size=4, drop_last=False)
    return sum(len(labels) for _, labels in DataLoader(ds.batched(), sampler=batches, batch_size=None, num_workers=2))


def _dali(ds) -> int:
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (pip install 'packer-images[dali]')")
    from packer.dali import pipeline

    pipe = pipeline(ds, 4, augment="none", device="cpu", py_workers=0)  # DALI's CPU build: device_id=None
    n = 0
    while True:
        try:
            _images, labels, _indices = pipe.run()
        except StopIteration:
            return n
        n += len(labels)


LOADERS = {"DataLoader, 2 workers": ("jpeg", _dataloader), "ThreadLoader": ("jpeg", _threadloader),
           "ds[i]": ("jpeg", _items), "get_batch": ("raw", _get_batch), "BatchView, 2 workers": ("raw", _batch_view),
           "DALI source": ("jpeg", _dali)}


@pytest.mark.parametrize("cache", [None, "ram"])
@pytest.mark.parametrize("name", list(LOADERS))
def test_every_loader_reads_through_the_one_loop(packed, name, cache):
    """Each sample a loader hands out was counted by ``BatchPipeline.run`` (the clock ``packer.instrument`` attaches
    counts the samples of every chunk it runs, in worker processes too): a loader with a loop of its own counts 0."""
    kind, load = LOADERS[name]
    ds = instrument(open_dataset(packed[kind], image="tensor", cache=cache, cache_options={"progress": False}))
    try:
        handed = load(ds)
        totals = clock_of(ds).totals()  # type: ignore[union-attr]
        assert handed == len(ds) and totals.samples == len(ds), (handed, totals)
        assert totals.seconds.get("read", 0) > 0 and (name == "DALI source" or totals.seconds.get("decode", 0) > 0)
    finally:
        ds.close()


def test_reading_outside_the_pipeline_is_not_counted(packed):
    """The count above can fail: samples read and decoded past the pipeline (as tools read one sample) count 0."""
    ds = instrument(open_dataset(packed["jpeg"], image="tensor"))
    for pos, payload in enumerate(ds.payloads_at(np.arange(len(ds)))):
        assert ds.pixels_at(pos, payload).ndim == 3
    assert clock_of(ds).totals().samples == 0  # type: ignore[union-attr]


def test_no_clock_no_timer(packed, monkeypatch):
    """Without a clock the loop takes no timestamps (``time.perf_counter`` is never called)."""
    import packer.read.pipeline as pipeline_mod

    ds = open_dataset(packed["jpeg"], image="tensor")
    calls: list[int] = []
    real = pipeline_mod.time.perf_counter

    class Clockless:
        @staticmethod
        def perf_counter() -> float:
            calls.append(1)
            return real()

    monkeypatch.setattr(pipeline_mod, "time", Clockless)
    assert len(ds.__getitems__(list(range(len(ds))))) == len(ds) and torch.is_tensor(ds[0][0])
    assert calls == []
    instrument(ds)
    ds.__getitems__([0, 1])
    assert calls  # with a clock: timed


def test_the_sample_source_interface_is_small():
    """At most five methods, implemented by the shard store, the RAM cache and a URL's ranged source."""
    methods = {name for name, fn in inspect.getmembers(SampleSource, inspect.isfunction) if not name.startswith("_")}
    assert methods == {"start", "payloads", "decode", "follow", "close"} and len(methods) <= 5
    assert {"start", "payloads"} <= set(SampleSource.__abstractmethods__)
    assert issubclass(ShardStore, SampleSource) and issubclass(RamCache, SampleSource)
