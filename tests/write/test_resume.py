"""Interrupted conversions resume to the same bytes; the same input always gives the same bytes."""

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.imagesets import make_imagefolder
from support.interrupt import kill_after_shards
from support.mounts import small_tmpfs

from packer import PackerError, convert
from packer.tools.verify import verify

REPO = Path(__file__).resolve().parents[2]


def tree_digest(root: Path, skip=("manifest.json",)) -> dict[str, str]:
    """sha256 of every file below root (the manifest holds a creation time, so it is compared apart)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def manifest_without_time(root: Path) -> str:
    import json

    data = json.loads((root / "manifest.json").read_text())
    data.pop("created_at")
    data.pop("source_digest")  # the source's mtimes when read (make_bad_inputs' /proc/self/mem link: per process)
    return json.dumps(data, sort_keys=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("res") / "src", classes=3, per_class=60, size=(48, 64))


def test_same_bytes_whatever_the_worker_count(source, tmp_path):
    convert(source, tmp_path / "a.lmdb", workers=0, shard_bytes=40_000, progress=False)
    convert(source, tmp_path / "b.lmdb", workers=2, shard_bytes=40_000, progress=False)
    convert(source, tmp_path / "c.lmdb", workers=2, shard_bytes=40_000, progress=False)
    a, b, c = (tree_digest(tmp_path / n) for n in ("a.lmdb", "b.lmdb", "c.lmdb"))
    assert a == b == c and len(a) > 8
    assert manifest_without_time(tmp_path / "a.lmdb") == manifest_without_time(tmp_path / "b.lmdb")


def test_resume_after_sigkill_is_byte_identical(tmp_path):
    # enough images that the kill surely lands mid-way, even on a fast, quiet machine
    source = make_imagefolder(tmp_path / "src", classes=3, per_class=300, size=(48, 64))
    before = tree_digest(source)
    reference = tmp_path / "ref.lmdb"
    convert(source, reference, workers=1, shard_bytes=40_000, progress=False)
    out = tmp_path / "out.lmdb"
    journal = tmp_path / "out.lmdb.partial" / "journal"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "packer", "convert", str(source), "-o", str(out), "--workers", "1",
           "--shard-size", "40000", "-q"]
    done_before = kill_after_shards(cmd, env, journal, shards=2)
    assert not out.exists()
    assert done_before >= 2

    res = subprocess.run(cmd, env=env, capture_output=True, text=True)  # without --resume: refused, with the way out
    assert res.returncode == 2 and "--resume" in res.stderr and "rm -r" in res.stderr

    res = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert tree_digest(out) == tree_digest(reference)
    assert manifest_without_time(out) == manifest_without_time(reference)
    assert verify(out, against=source).ok
    assert tree_digest(source) == before  # the source is never modified


def test_resume_of_a_finished_conversion_says_so_and_does_nothing(source, tmp_path):
    """``--resume`` pasted after a run that finished (the README's Converting block does it): exit 0 with one line
    saying the dataset is complete and nothing was done, the dataset untouched; it once said only "already exists
    (use --overwrite ...)" and exited 2."""
    out = tmp_path / "done.lmdb"
    convert(source, out, workers=0, shard_bytes=40_000, progress=False)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "packer", "convert", str(source), "-o", str(out), "--shard-size", "40000", "--resume"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout == (f"nothing to resume: {out} is complete (the same options, the same source files, sizes and "
                          "times); nothing was done\n")
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before
    assert not (tmp_path / "done.lmdb.partial").exists()
    result = convert(source, out, shard_bytes=40_000, resume=True, progress=False)
    assert result.nothing_to_resume and not result.reused and result.num_samples == 180
    # another conversion's dataset (other options, or the source changed since): refused, naming the difference
    res = subprocess.run(cmd + ["--validate", "header"], env=env, capture_output=True, text=True)
    assert res.returncode == 2 and "nothing to resume" in res.stderr and "validate full -> header" in res.stderr
    assert "--overwrite" in res.stderr and "Traceback" not in res.stderr
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()} == before


def test_resume_refuses_a_changed_source(source, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(source, src)
    partial = tmp_path / "o.lmdb.partial"
    # a conversion that stops at the first bad file leaves nothing; so simulate an interruption by
    # planning, then changing the source
    from packer.write.options import ConvertOptions
    from packer.write.output import Output
    from packer.write.plan import load_or_make_plan
    from packer.write.scan import scan_folder

    _, lock = load_or_make_plan(scan_folder(src), Output(tmp_path / "o.lmdb"), ConvertOptions(shard_bytes=40_000),
                                False)
    assert partial.is_dir()
    lock.release()  # the interrupted run ends
    (src / "class_0" / "img_000.jpg").unlink()
    with pytest.raises(PackerError, match="changed since the interrupted run"):
        convert(src, tmp_path / "o.lmdb", shard_bytes=40_000, resume=True, progress=False)


def test_disk_full_is_a_clear_error_and_nothing_looks_complete(source, tmp_path):
    with small_tmpfs(tmp_path / "small", "300k") as small:
        before = tree_digest(source)
        from unittest import mock

        # the up-front space check would refuse; pretend there is room to reach the real ENOSPC
        with mock.patch("packer.write.plan.check_free_space"), pytest.raises(PackerError) as err:
            convert(source, small / "o.lmdb", workers=1, shard_bytes=40_000, progress=False)
        msg = str(err.value)
        assert str(small / "o.lmdb") in msg and ("space" in msg.lower() or "full" in msg.lower())
        assert "resume=True" in msg
        assert not (small / "o.lmdb").exists()
        assert not (small / "o.lmdb.partial" / "manifest.json").exists()
        assert tree_digest(source) == before


def test_up_front_space_check_refuses_before_writing(source, tmp_path, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(PackerError, match="not enough free disk space"):
        convert(source, tmp_path / "o.lmdb", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_resume_packs_again_a_source_changed_since_the_interruption(source, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="packer")  # the notice is an INFO record (the CLI prints those)
    import importlib
    import json
    import shutil

    from packer import open_dataset

    pool = importlib.import_module("packer.write.pool")  # where the local backend finds write_shard
    src = tmp_path / "src"
    shutil.copytree(source, src)
    out = tmp_path / "o.lmdb"
    real_write_shard = pool.write_shard

    def interrupted(partial, shard_id, *args, **kwargs):  # Ctrl-C as the third shard starts
        if shard_id == 2:
            raise KeyboardInterrupt
        return real_write_shard(partial, shard_id, *args, **kwargs)

    monkeypatch.setattr(pool, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, workers=0, shard_bytes=40_000, progress=False)
    monkeypatch.undo()
    packed = json.loads((tmp_path / "o.lmdb.partial" / "journal" / "shard-00000.json").read_text())["rel_paths"]
    changed = src / packed[0]  # already packed: the same name now holds other bytes
    new = next(p for p in sorted(src.rglob("*.jpg")) if p != changed).read_bytes()
    mtime = changed.stat().st_mtime_ns
    changed.write_bytes(new)
    os.utime(changed, ns=(mtime + 10**9, mtime + 10**9))  # whatever the file system's clock granularity

    convert(src, out, workers=0, shard_bytes=40_000, resume=True, progress=False)
    ds = open_dataset(out)
    assert bytes(ds.read_payload(ds.index_of(packed[0]))) == new  # not the stale bytes of the first run
    assert verify(out, against=src).ok
    assert f"changed since the interrupted run ({packed[0]})" in caplog.text
