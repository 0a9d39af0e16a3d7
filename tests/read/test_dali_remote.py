"""packer.dali over a URL: a dataset opened by URL in ranged mode (packer/read/ranged.py) feeds DALI's pipeline
(CPU build, ``device_id=None``, as tests/read/test_dali.py) the same pixels and labels as the local folder, in
the calling thread and in DALI's parallel workers (fork and spawn), every sample once per epoch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.imagesets import make_imagefolder
from support.storage_servers import open_served, serve_copy

from packer import convert
from packer.read.ranged import RangedSource
from tests.read.test_dali import check_against_open_dataset, dali_or_skip, epoch_samples, plain_exception_pickling

__all__ = ["plain_exception_pickling"]  # the fixture, used by name

URL = "s3://bucket/ds.lmdb"


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    """18 JPEGs of varying sizes in 3 classes as lmdb in several shards (ranges recorded: ranged mode)."""
    root = make_imagefolder(tmp_path_factory.mktemp("dali-url") / "imgs", classes=3, per_class=6)
    out = root.with_name("ds.lmdb")
    convert(root, out, shard_bytes=6_000, workers=0, progress=False)
    return out


@pytest.fixture
def served(local, tmp_path):
    server = serve_copy(local, tmp_path / "root")
    yield server
    server.stop()


def test_a_url_in_ranged_mode_feeds_dali_the_local_pixels(served, local, tmp_path):
    dali_or_skip()
    from packer.dali import pipeline

    with open_served(served, tmp_path / "cache", URL, remote_mode="ranged") as ds:
        assert isinstance(ds.source, RangedSource) and len(ds.manifest.shards) > 1
        pipe = pipeline(ds, 4, augment="none", seed=1)
        first, second = epoch_samples(pipe), epoch_samples(pipe)
        check_against_open_dataset(local, first)
        check_against_open_dataset(local, second)
        assert [i for i, _, _ in first] != [i for i, _, _ in second]  # the next epoch's block order
        assert served.server.stats.settled()["gets"] > 0  # read from the store, not from a local copy


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dali_parallel_workers_read_a_url_dataset(served, local, tmp_path, method, plain_exception_pickling):
    dali_or_skip()
    from packer.dali import pipeline

    with open_served(served, tmp_path / "cache", URL, remote_mode="ranged") as ds:
        ds[0]  # the parent has used the store before DALI forks its workers (obstore does not survive fork)
        pipe = pipeline(ds, 4, augment="none", py_workers=2, py_start_method=method)
        samples = epoch_samples(pipe)
        check_against_open_dataset(local, samples)
        labels = sorted(label for _, label, _ in samples)
        assert labels == sorted(np.asarray(ds.index.labels).tolist())
