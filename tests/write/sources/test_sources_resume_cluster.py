"""Sources other than a folder on the other paths of a conversion: Dask workers, and resume after a kill."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from packer import convert
from packer.tools.verify import verify
from tests.support.imagesets import make_bad_inputs, make_imagefolder
from tests.support.interrupt import kill_after_shards
from tests.write.sources.test_archive import make_nested, make_tar
from tests.write.test_resume import manifest_without_time, tree_digest

REPO = Path(__file__).resolve().parents[3]
SHARD = 40_000


@pytest.fixture(scope="module")
def imgs(tmp_path_factory) -> Path:
    root = make_imagefolder(tmp_path_factory.mktemp("rc") / "imgs", classes=3, per_class=20, size=(48, 64))
    make_bad_inputs(root)
    return root


@pytest.fixture(scope="module")
def listing(imgs) -> Path:
    path = imgs.parent / "labels.csv"
    rows = [f"{p.relative_to(imgs).as_posix()},{p.parent.name}" for p in sorted(imgs.rglob("*.jpg"))]
    path.write_text("path,label\n" + "\n".join(rows + ["class_0/missing.jpg,class_0", "../x.jpg,class_1"]) + "\n")
    return path


def test_dask_of_a_list_file_and_a_nested_tar_equals_a_local_run(imgs, listing, tmp_path):
    distributed = pytest.importorskip("distributed", reason="needs the packer[dask] extra")
    from packer.write.cluster import open_client

    nested = make_nested(imgs, tmp_path / "train.tar")
    with open_client("local:2") as client:
        assert isinstance(client, distributed.Client)
        for src, kw in ((listing, {"root": imgs}), (nested, {})):
            local = convert(src, tmp_path / f"{src.stem}-local.lmdb", workers=0, shard_bytes=SHARD, progress=False,
                            **kw).output
            dask = convert(src, tmp_path / f"{src.stem}-dask.lmdb", client=client, shard_bytes=SHARD, progress=False,
                           **kw).output
            assert len(list(local.glob("*.lmdb"))) + len(list(local.glob("**/data.mdb"))) >= 3
            assert tree_digest(dask) == tree_digest(local)  # shards, meta/*.npy, errors.json
            assert manifest_without_time(dask) == manifest_without_time(local)
            assert verify(dask, against=src).ok


@pytest.mark.parametrize("nested", [False, True], ids=["tar", "nested-tar"])
def test_resume_of_a_killed_archive_conversion_is_byte_identical(imgs, tmp_path, nested):
    archive = (make_nested if nested else make_tar)(imgs, tmp_path / "a.tar")
    reference = convert(archive, tmp_path / "ref.lmdb", workers=0, shard_bytes=SHARD, progress=False).output
    out = tmp_path / "o.lmdb"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "packer", "convert", str(archive), "-o", str(out), "--shard-size", str(SHARD),
           "--workers", "1", "-q"]
    assert kill_after_shards(cmd, env, out.with_name("o.lmdb.partial") / "journal", shards=2) >= 2
    assert not out.exists()
    res = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True)
    assert res.returncode == 1, res.stderr  # 1: some files (the bad inputs) are in errors.json
    assert tree_digest(out) == tree_digest(reference)
    assert manifest_without_time(out) == manifest_without_time(reference)
    assert verify(out, against=archive).ok
