"""A dataset dropped without ``close()`` gives its files back, as a Python file object does.

Code that opens a dataset per trial, per fold or per test and never closes it (the usual way) must not keep a
descriptor per shard open for the life of the process: CI ran out of ``select()``'s 1,024 after a few hundred opens.
"""

from __future__ import annotations

import gc

import pytest
from support.fds import open_files_under

from packer import FORMATS, convert, open_dataset

OPTIONS: dict[str, dict] = {"mosaic": {"tile": "32x48"}}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_dataset_dropped_unclosed_leaves_no_file_open(name, imagefolder, tmp_path):
    out = tmp_path / f"ds.{name}"
    convert(imagefolder, out, to=name, shard_bytes=6_000, progress=False, **OPTIONS.get(name, {}))
    for _ in range(3):
        ds = open_dataset(out, image="numpy")
        ds[0]
        ds.__getitems__(list(range(len(ds))))
        if name != "bmp":  # one file per image, opened per read
            assert open_files_under(out), "the reads should hold the shards open while the dataset lives"
        del ds
    gc.collect()
    assert open_files_under(out) == []


def test_a_view_handed_out_outlives_the_dataset(imagefolder, tmp_path):
    """Dropping the dataset closes descriptors, never maps a caller still reads: its payload views stay valid."""
    out = tmp_path / "ds.lmdb"
    convert(imagefolder, out, to="lmdb", progress=False)
    ds = open_dataset(out, image="numpy")
    view = ds.read_payload(0)
    expected = bytes(view)
    del ds
    gc.collect()
    assert bytes(view) == expected
