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
from support.imagesets import make_imagefolder
from support.memlimit import limited_call

from packer import PackerError, ThreadLoader, convert, open_dataset

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
        convert(imagefolder, root / name, workers=0, progress=False, **options)
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
    convert(imagefolder, tmp_path / "ds", to="memmap", payload="raw", workers=0, progress=False)
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


THREADED_TRIALS = 8  # per case: on the code before, most cases died of SIGBUS in most trials
# every format, compressed layouts too (their reads inflate from reads, not maps)
THREADED_CASES = {**CASES, "n5": {"to": "n5"}, "n5-raw": {"to": "n5", "payload": "raw"},
                  "n5-gzip": {"to": "n5", "payload": "raw", "compression": "gzip"},
                  "hdf5-lzf": {"to": "hdf5", "payload": "raw", "compression": "lzf"}}


@pytest.fixture(scope="module")
def threaded_bases(tmp_path_factory):
    """The cases over 60 photos of 64x80 in several shards: batches of 2 are still being decoded by the threads
    while the test truncates the last shard."""
    root = tmp_path_factory.mktemp("threaded-truncation")
    imgs = make_imagefolder(root / "imgs", classes=3, per_class=20, size=(64, 80))
    for name, options in THREADED_CASES.items():
        shard_bytes = {"bmp": None, "mosaic": None, "mosaic-jpeg": None}.get(name, 40_000)
        convert(imgs, root / name, workers=0, progress=False, shard_bytes=shard_bytes, **options)
    return root


def _largest_file(manifest) -> str:
    """The last shard's largest file: its data (not an n5 shard's attributes, read once on opening)."""
    return max(manifest.shards[-1].files, key=lambda f: f.num_bytes).name


def _truncate_under_threads(base: Path, work: Path, trials: int) -> list[list[str]]:
    """Per trial: a fresh copy, a ThreadLoader(batch_size=2, num_threads=2) over it, the last shard (its largest
    file) truncated to a third in place after the second batch; the outcome of every batch: "ok" or the error."""
    runs = []
    for trial in range(trials):
        copy = work / f"trial-{trial}"
        shutil.copytree(base, copy)
        ds = open_dataset(copy, image="numpy")
        target = copy / _largest_file(ds.manifest)
        outcomes: list[str] = []
        loader = ThreadLoader(ds, batch_size=2, num_threads=2)
        batches = iter(loader)
        while True:
            try:
                next(batches)
                outcomes.append("ok")
            except StopIteration:
                break
            except PackerError as exc:
                outcomes.append(f"PackerError: {exc}")
            except Exception as exc:  # noqa: BLE001 - any other failure is what the test reports
                outcomes.append(f"{type(exc).__name__}: {exc}")
            if len(outcomes) == 2:
                os.truncate(target, target.stat().st_size // 3)
        loader.close()
        ds.close()
        shutil.rmtree(copy)
        runs.append(outcomes)
    return runs


@pytest.mark.parametrize("case", list(THREADED_CASES))
def test_a_shard_truncated_under_thread_loader_is_a_packer_error_never_sigbus(threaded_bases, tmp_path, case):
    """ThreadLoader's decode threads read copies of the stored bytes (``payloads_at(into=)``: ``pread``, never a
    map), so a shard truncated while they run gives DataLoader's PackerError, in every trial, in a child process
    (a SIGBUS there kills only it). Batches read before the truncation come out whole."""
    kind, runs = limited_call(_truncate_under_threads, threaded_bases / case, tmp_path, THREADED_TRIALS)
    assert kind == "ok", (kind, runs)  # "died": the child was killed (SIGBUS)
    name = _largest_file(open_dataset(threaded_bases / case).manifest)
    for outcomes in runs:
        errors = [o for o in outcomes if o != "ok"]
        assert outcomes[:2] == ["ok", "ok"] and errors, outcomes
        assert all(e.startswith("PackerError: ") and name in e for e in errors), errors
        if case == "bmp":  # one file per sample, read whole: the short one is a damaged BMP file
            assert all("damaged BMP file" in e for e in errors), errors
        else:  # as a DataLoader's reads say it; a shard first opened after the truncation may say so on opening
            assert all("changed size since it was opened" in e or "truncated" in e for e in errors), errors
