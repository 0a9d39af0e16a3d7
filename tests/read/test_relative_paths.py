"""A dataset opened by a relative path keeps reading the same files after os.chdir, in spawn
workers and when unpickled in another process (Hydra changes the working directory, for one)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.imagesets import make_imagefolder
from support.spawned import Fetch, probe_for

from packer import convert, open_dataset

FORMATS = {"lmdb": {}, "hdf5": {}, "memmap": {"payload": "raw", "resize": "16x16"}, "bmp": {},
           "mosaic": {"tile": "16x16", "grid": "2x2"}}


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    base = tmp_path_factory.mktemp("rel")
    src = make_imagefolder(base / "imgs", classes=2, per_class=3)
    return {fmt: convert(src, base / f"ds.{fmt}", to=fmt, workers=0, progress=False, **opts).output
            for fmt, opts in FORMATS.items()}


def pixels(ds) -> list[bytes]:
    return [np.ascontiguousarray(ds[i][0]).tobytes() for i in range(len(ds))]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_relative_path_survives_chdir_and_pickling(packed, fmt, tmp_path, monkeypatch):
    expected = pixels(open_dataset(packed[fmt], image="numpy"))
    monkeypatch.chdir(packed[fmt].parent)
    ds = open_dataset(packed[fmt].name, image="numpy")  # nothing read yet: shards open lazily
    copy = pickle.dumps(ds)
    monkeypatch.chdir(tmp_path)
    assert ds.root.is_absolute() and ds.root == packed[fmt]
    assert pixels(ds) == expected
    assert pixels(pickle.loads(copy)) == expected


def test_spawn_worker_after_chdir(spawned):
    """Read by a spawned worker started in another folder (_spawned_relative)."""
    got = [np.ascontiguousarray(img).tobytes() for img, _ in spawned.values()]
    assert got == pixels(open_dataset(spawned.context, image="numpy"))


@probe_for(test_spawn_worker_after_chdir)
def _spawned_relative(tmp_path_factory):
    """Each sample of an lmdb opened by a relative path, read by spawned workers that start in another folder (the
    session's spawned DataLoader starts in a folder of its own). Context: the absolute path."""
    base = tmp_path_factory.mktemp("rel")
    path = Path(convert(make_imagefolder(base / "imgs", classes=2, per_class=3), base / "ds.lmdb", workers=0,
                        progress=False).output)
    here = os.getcwd()
    os.chdir(base)
    try:
        ds = open_dataset(path.name, image="numpy")
    finally:
        os.chdir(here)
    return Fetch(ds, range(len(ds)), batched=False), path


def test_unpickled_in_another_process_started_elsewhere(packed, tmp_path, monkeypatch):
    monkeypatch.chdir(packed["hdf5"].parent)
    blob = tmp_path / "ds.pickle"
    blob.write_bytes(pickle.dumps(open_dataset(packed["hdf5"].name, image="numpy")))
    code = "import pickle, sys; ds = pickle.load(open(sys.argv[1], 'rb')); print(len(ds), ds[len(ds) - 1][1])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    res = subprocess.run([sys.executable, "-c", code, str(blob)], cwd=tmp_path, capture_output=True, text=True, env=env)
    ds = open_dataset(packed["hdf5"])
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == [str(len(ds)), str(ds[len(ds) - 1][1])]
