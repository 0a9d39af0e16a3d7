"""Many readers at once, read-only copies and mounts, and readers while --overwrite replaces a dataset."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from support.imagesets import make_imagefolder
from support.mounts import read_only_mount
from torch.utils.data import DataLoader

from packer import PackerError, convert, open_dataset
from packer.tools.verify import verify


def digest(img) -> str:
    return hashlib.sha1(np.ascontiguousarray(img).tobytes()).hexdigest()


def digests(path) -> list[tuple[str, int]]:
    ds = open_dataset(path, image="numpy")
    out = [(digest(ds[i][0]), ds[i][1]) for i in range(len(ds))]
    ds.close()
    return out


@pytest.fixture(scope="module")
def packed(imagefolder, tmp_path_factory):
    out = tmp_path_factory.mktemp("conc") / "ds.lmdb"
    convert(imagefolder, out, to="lmdb", shard_bytes=6_000, workers=1, progress=False)
    return out


def _job(path: str, queue) -> None:
    """One training job: a DataLoader with 2 workers over the whole dataset, shuffled."""
    try:
        ds = open_dataset(path, image="numpy", transform=digest)
        loader = DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, multiprocessing_context="fork",
                            generator=torch.Generator().manual_seed(os.getpid()))
        seen = sorted((d, int(t)) for ds_, ts in loader for d, t in zip(ds_, ts))
        queue.put(("ok", seen))
    except BaseException as exc:  # reported to the test, which fails on it
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def run_jobs(path: Path, jobs: int = 4) -> list:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_job, args=(str(path), queue)) for _ in range(jobs)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return results


def _read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        os.chmod(p, os.stat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_four_jobs_with_workers_read_a_read_only_copy(packed, tmp_path):
    copy = tmp_path / "ro.lmdb"
    shutil.copytree(packed, copy)
    _read_only(copy)
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*")}
    expected = sorted(digests(packed))
    for status, seen in run_jobs(copy, jobs=4):
        assert status == "ok", seen
        assert seen == expected  # every sample exactly once, in each job
    assert {p: p.stat().st_mtime_ns for p in copy.rglob("*")} == before
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in packed.iterdir())  # no lock files
    assert verify(copy).ok


def test_jobs_read_from_a_read_only_filesystem(packed, tmp_path):
    with read_only_mount(packed, tmp_path / "mnt") as ro:
        with pytest.raises(OSError, match="Read-only file system"):
            (ro / "probe").write_bytes(b"")
        expected = sorted(digests(packed))
        for status, seen in run_jobs(ro, jobs=3):
            assert status == "ok", seen
            assert seen == expected
        assert verify(ro, deep=True).ok


# ------------------------------------------------------------------ replaced while being read


@pytest.fixture
def two_versions(tmp_path):
    """(path, old digests, new source): a dataset, and a different folder to convert over it."""
    old_src = make_imagefolder(tmp_path / "old", per_class=4, seed=11)
    new_src = make_imagefolder(tmp_path / "new", per_class=4, seed=12)
    path = tmp_path / "ds.lmdb"
    convert(old_src, path, to="lmdb", shard_bytes=6_000, workers=1, progress=False)
    return path, digests(path), new_src


def test_open_dataset_keeps_reading_its_files_after_overwrite(two_versions):
    path, old, new_src = two_versions
    ds = open_dataset(path, image="numpy")
    for i in range(len(ds)):  # opens every shard
        ds[i]
    convert(new_src, path, to="lmdb", shard_bytes=6_000, workers=1, progress=False, overwrite=True)
    assert digests(path) != old  # the new dataset is in place
    assert [(digest(ds[i][0]), ds[i][1]) for i in range(len(ds))] == old  # the open one reads the old files


def test_dataset_opened_but_not_yet_read_fails_clearly_after_overwrite(two_versions):
    path, old, new_src = two_versions
    ds = open_dataset(path, image="numpy")  # index loaded, shards not opened yet
    convert(new_src, path, to="lmdb", shard_bytes=6_000, workers=1, progress=False, overwrite=True)
    with pytest.raises(PackerError, match="replaced since this dataset was opened"):
        ds[0]


def test_forked_workers_after_overwrite_fail_clearly(two_versions):
    path, old, new_src = two_versions
    ds = open_dataset(path, image="numpy")
    ds[0]
    convert(new_src, path, to="lmdb", shard_bytes=6_000, workers=1, progress=False, overwrite=True)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    with pytest.raises(PackerError, match="replaced"):
        list(loader)


def _reopen_loop(path: str, stop, queue) -> None:
    """Open and read the whole dataset again and again: each pass is all old, all new, or a PackerError."""
    passes = []
    while not stop.is_set():
        try:
            passes.append(digests(path))
        except PackerError as exc:
            passes.append(str(exc))
        except Exception as exc:  # not packer's error: the test fails on it
            passes.append(f"UNEXPECTED {type(exc).__name__}: {exc}")
    queue.put(passes)


def test_readers_during_overwrite_see_one_whole_version_or_an_error(two_versions):
    path, old, new_src = two_versions
    reference = new_src.parent / "reference-new.lmdb"
    convert(new_src, reference, to="lmdb", shard_bytes=6_000, workers=1, progress=False)
    new = digests(reference)
    ctx = mp.get_context("fork")
    stop, queue = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_reopen_loop, args=(str(path), stop, queue)) for _ in range(2)]
    for r in readers:
        r.start()
    for _ in range(3):
        convert(new_src, path, to="lmdb", shard_bytes=6_000, workers=1, progress=False, overwrite=True)
        convert(new_src.parent / "old", path, to="lmdb", shard_bytes=6_000, workers=1, progress=False, overwrite=True)
    stop.set()
    passes = [p for _ in readers for p in queue.get(timeout=60)]
    for r in readers:
        r.join(timeout=30)
    whole = [p for p in passes if isinstance(p, list)]
    print(f"passes: {sum(p == old for p in whole)} old, {sum(p == new for p in whole)} new, "
          f"{len(passes) - len(whole)} errors")
    assert whole, "the readers never completed a pass"
    for p in whole:
        assert p == old or p == new, "a pass read a mix of two versions"
    for p in passes:
        if isinstance(p, str):
            assert not p.startswith("UNEXPECTED"), p  # a PackerError (e.g. between the two renames)
