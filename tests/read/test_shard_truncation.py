"""A shard truncated in place while a dataset has it open (``rsync --inplace``, ``cp`` over it):
the next read is a PackerError asking to reopen the dataset, never a SIGBUS and never damaged
pixels returned as if nothing happened.

Each case opens a dataset, reads a sample (so the shard is open and mapped), truncates the shard
file in place and reads again, in a forked child (tests/support/memlimit.py) so that a SIGBUS kills only
the child and is reported as such.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support.memlimit import limited_call

from packer import PackerError, convert, open_dataset

CASES = {
    "lmdb": {"to": "lmdb"},
    "lmdb-raw": {"to": "lmdb", "payload": "raw"},
    "lmdb-fixed": {"to": "lmdb", "payload": "raw", "resize": "16x16"},
    "memmap": {"to": "memmap"},
    "memmap-fixed": {"to": "memmap", "payload": "raw", "resize": "16x16"},
    "hdf5": {"to": "hdf5"},
    "hdf5-fixed": {"to": "hdf5", "payload": "raw", "resize": "16x16"},
    "mosaic": {"to": "mosaic", "tile": "16x16", "grid": "4x4"},
    "mosaic-jpeg": {"to": "mosaic", "tile": "16x16", "grid": "4x4", "codec": "jpeg"},
    "bmp": {"to": "bmp"},
    "recordio": {"to": "recordio"},
    "pth": {"to": "pth"},
    "safetensors": {"to": "safetensors"},
}


@pytest.fixture(scope="module")
def bases(imagefolder, tmp_path_factory):
    root = tmp_path_factory.mktemp("truncation")
    for name, options in CASES.items():
        convert(imagefolder, root / name, workers=1, progress=False, **options)
    return root


def _truncate_while_open(path: Path, keep: float, file: int = 0) -> list[str]:
    """Read the first sample stored, truncate file ``file`` of its shard to ``keep`` of its size, then read every
    way: the outcomes."""
    ds = open_dataset(path, image="numpy")
    ds[ds.index_map.public(0)]
    shard = ds.manifest.shards[0]
    target = path / shard.files[file].name
    os.truncate(target, int(target.stat().st_size * keep))
    n = shard.num_samples
    mine = ds.index_map.public_many(range(n)).tolist()  # the samples stored in shard 0, in storage order
    outcomes = []
    for call in [lambda i=i: ds[i] for i in mine] + [
            lambda: ds.read_payloads(mine), lambda: ds.__getitems__(mine),
            lambda: ds.get_batch(mine)]:
        try:
            call()
            outcomes.append("ok")
        except PackerError as exc:
            outcomes.append(str(exc))
    return outcomes


@pytest.mark.parametrize("keep", [0.5, 0.0])
@pytest.mark.parametrize("case", list(CASES))
def test_reading_a_shard_truncated_while_open_is_a_packer_error(bases, tmp_path, case, keep):
    ds = tmp_path / case
    shutil.copytree(bases / case, ds)
    kind, outcomes = limited_call(_truncate_while_open, ds, keep)
    assert kind == "ok", (kind, outcomes)  # "died": the child was killed (SIGBUS)
    if case == "bmp":  # one file per sample, read whole (no map): the short one is a damaged BMP file
        assert "damaged BMP file" in outcomes[0] and outcomes[1] == "ok", outcomes
        return
    assert all("changed size since it was opened" in o and "reopen the dataset" in o for o in outcomes), outcomes


@pytest.mark.parametrize("file", [1, 2], ids=["offsets", "shapes"])
def test_memmap_index_files_truncated_while_open(imagefolder, tmp_path, file):
    """A memmap shard's offsets and shapes are mapped too: their size is checked as the data's is."""
    convert(imagefolder, tmp_path / "ds", to="memmap", payload="raw", workers=1, progress=False)
    kind, outcomes = limited_call(_truncate_while_open, tmp_path / "ds", 0.0, file)
    assert kind == "ok", (kind, outcomes)
    assert all("changed size since it was opened" in o for o in outcomes), outcomes


def test_payload_sizes_are_counted_alike_whatever_else_the_batch_holds():
    """Views and arrays count their bytes (one C-level pass when all are); anything else its length, as before."""
    import numpy as np
    import torch

    from packer.read.store import _sizes

    arr, view, tensor = np.zeros((4, 5, 3), np.uint8), memoryview(b"abcdef"), torch.zeros((4, 5, 3), dtype=torch.uint8)
    assert _sizes([arr, view]).tolist() == [60, 6] == _sizes([arr, view, b"xy"]).tolist()[:2]
    assert _sizes([tensor]).tolist() == [4] == _sizes([tensor, b"xy"]).tolist()[:1]
    assert _sizes([]).tolist() == []
