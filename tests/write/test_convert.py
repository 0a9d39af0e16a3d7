import importlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from support.cli import run_cli
from support.imagesets import make_bad_inputs, make_imagefolder
from support.interrupt import kill_after_shards

from packer import convert, open_dataset
from packer.errors import PackerError
from packer.images.decode import decode_pil
from packer.tools.verify import verify

REPO = Path(__file__).resolve().parents[2]


def test_every_bad_input_is_packed_or_reported(tmp_path):
    expect = make_bad_inputs(tmp_path / "src")
    res = convert(tmp_path / "src", tmp_path / "out.lmdb", workers=2, progress=False)
    ds = open_dataset(res.output, image="numpy")
    packed = set(ds.index.rel_paths())
    report = json.loads((res.output / "errors.json").read_text())
    reported = {e["path"]: e["reason"] for e in report["errors"]}
    assert packed == {p for p, ok in expect.items() if ok}
    assert set(reported) == {p for p, ok in expect.items() if not ok}
    assert report["ignored"] == {"not an image": 1}  # .hidden.jpg is packed, as ImageFolder keeps it
    assert "empty" in reported["weird/empty.jpg"]
    assert "broken symbolic link" in reported["weird/broken_link.jpg"]
    truncated = reported["weird/truncated.jpg"].lower()
    assert "truncated" in truncated or "premature" in truncated
    # valid oddities decode exactly as Pillow does
    for rel in packed:
        i = ds.index_of(rel)
        src = (tmp_path / "src" / rel).read_bytes()
        assert bytes(ds.read_payload(i)) == src
        assert np.array_equal(ds[i][0], decode_pil(src)), rel
    assert verify(res.output, against=tmp_path / "src").ok


def test_header_validation_packs_truncated_files_but_not_garbage(tmp_path):
    expect = make_bad_inputs(tmp_path / "src")
    res = convert(tmp_path / "src", tmp_path / "out.lmdb", validate="header", workers=0, progress=False)
    packed = set(open_dataset(res.output).index.rel_paths())
    assert "weird/truncated.jpg" in packed  # only a full decode notices
    assert "weird/random.jpg" not in packed and "weird/empty.jpg" not in packed
    assert len(packed) + len(res.errors) == len(expect)


def test_on_error_raise_names_the_file_and_leaves_nothing(tmp_path):
    make_bad_inputs(tmp_path / "src")
    with pytest.raises(PackerError, match=r"weird/.*\.jpg"):
        convert(tmp_path / "src", tmp_path / "out.lmdb", on_error="raise", workers=0, progress=False)
    assert not (tmp_path / "out.lmdb").exists() and not (tmp_path / "out.lmdb.partial").exists()


def test_refuses_to_overwrite_and_replaces_atomically(imagefolder, tmp_path):
    out = tmp_path / "o.lmdb"
    convert(imagefolder, out, workers=0, progress=False)
    with pytest.raises(PackerError, match="already exists"):
        convert(imagefolder, out, workers=0, progress=False)
    convert(imagefolder, out, workers=0, progress=False, overwrite=True)
    assert verify(out).ok and not (tmp_path / "o.lmdb.old").exists()


def test_default_output_is_beside_the_source(tmp_path):
    src = make_imagefolder(tmp_path / "pics", classes=2, per_class=2)
    res = run_cli("convert", src, "--to", "lmdb", "-q")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "pics.lmdb" / "manifest.json").is_file()


def test_cli_exit_codes(tmp_path):
    make_bad_inputs(tmp_path / "src")
    res = run_cli("convert", tmp_path / "src", "-o", tmp_path / "o.lmdb", "-q")
    assert res.returncode == 1 and "not packed" in res.stderr  # problems found, summarised on stderr
    assert run_cli("convert", tmp_path / "missing").returncode == 2
    assert run_cli("convert", tmp_path / "src", "--to", "nope").returncode == 2


def test_interrupted_conversion_leaves_no_complete_looking_output(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=4, per_class=400, size=(64, 80))
    out = tmp_path / "big.lmdb"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # small shards: the kill lands after the first shard is journaled and long before the last
    cmd = [sys.executable, "-m", "packer", "convert", str(src), "-o", str(out), "--workers", "1",
           "--shard-size", "20000", "-q"]
    kill_after_shards(cmd, env, tmp_path / "big.lmdb.partial" / "journal")
    assert not out.exists()
    assert not (tmp_path / "big.lmdb.partial" / "manifest.json").exists()
    with pytest.raises(PackerError, match="interrupted conversion"):
        convert(src, out, progress=False)


def test_unknown_options_are_refused_by_name(imagefolder, tmp_path):
    with pytest.raises(PackerError, match="unknown conversion option.*resise"):
        convert(imagefolder, tmp_path / "o.lmdb", resise="224", progress=False)
    assert not (tmp_path / "o.lmdb").exists()


def test_files_that_vanish_or_change_during_the_run_are_reported(tmp_path, monkeypatch):
    conv = importlib.import_module("packer.write.convert")
    folder = importlib.import_module("packer.write.sources.folder")  # where the folder source scans

    src = make_imagefolder(tmp_path / "src", classes=2, per_class=3)
    real_scan = folder.scan_folder

    def scan_then_delete(root, *args, **kwargs):  # the file disappears after the scan listed it
        scan = real_scan(root, *args, **kwargs)
        (Path(root) / "class_0" / "img_001.jpg").unlink()
        return scan

    real_fstat = os.fstat
    target = (src / "class_1" / "img_002.jpg").stat().st_ino

    def fstat_growing(fd):  # the file grows between the size check and the read
        st = real_fstat(fd)
        if st.st_ino == target:
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid,
                                   st.st_size + 100, st.st_atime, st.st_mtime, st.st_ctime))
        return st

    monkeypatch.setattr(folder, "scan_folder", scan_then_delete)
    monkeypatch.setattr(conv.os, "fstat", fstat_growing)
    res = convert(src, tmp_path / "o.lmdb", workers=0, progress=False)
    reasons = {e.path: e.reason for e in res.errors}
    assert "No such file" in reasons["class_0/img_001.jpg"]
    assert "changed while being read" in reasons["class_1/img_002.jpg"]
    assert res.num_samples == 4 and len(res.errors) == 2


def test_a_fifo_in_the_source_is_reported_never_waited_on(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=3)
    os.mkfifo(src / "class_0" / "pipe.jpg")  # no writer: a blocking open would wait forever
    out = tmp_path / "o.bmp"  # a raw payload: the size estimate opens sources too
    res = run_cli("convert", src, "-o", out, "--to", "bmp", "--workers", "0", "-q", timeout=120)
    assert res.returncode == 1, res.stderr
    reasons = {e["path"]: e["reason"] for e in json.loads((out / "errors.json").read_text())["errors"]}
    assert list(reasons) == ["class_0/pipe.jpg"] and "not a regular file" in reasons["class_0/pipe.jpg"]


def test_a_file_rewritten_while_being_read_is_reported_not_packed(tmp_path, monkeypatch):
    src = make_imagefolder(tmp_path / "src", classes=1, per_class=3)
    target = (src / "class_0" / "img_001.jpg").stat().st_ino
    real_fstat = os.fstat
    seen = []

    def fstat_rewritten(fd):  # same size, a new mtime after the read: rewritten in place meanwhile
        st = real_fstat(fd)
        if st.st_ino != target:
            return st
        seen.append(fd)
        return st if len(seen) == 1 else os.stat_result(tuple(st), {"st_mtime_ns": st.st_mtime_ns + 1})

    monkeypatch.setattr(os, "fstat", fstat_rewritten)
    res = convert(src, tmp_path / "o.lmdb", workers=0, progress=False)
    assert [(e.path, e.reason) for e in res.errors] == [("class_0/img_001.jpg", "cannot read: changed while being "
                                                         "read (modified meanwhile)")]
    assert res.num_samples == 2


def test_names_that_are_not_utf8_are_packed_and_extracted_unchanged(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=2)
    good = (src / "class_0" / "img_000.jpg").read_bytes()
    raw_src = os.fsencode(src)
    os.mkdir(raw_src + b"/cl\xffass")  # a class folder too
    named = ((b"cl\xffass/p\xfe.jpg", good), (b"class_0/bad\xff.jpg", good), (b"class_1/junk\xff.jpg", b"junk"))
    for name, data in named:
        with open(raw_src + b"/" + name, "wb") as fh:
            fh.write(data)
    res = convert(src, tmp_path / "o.lmdb", workers=1, progress=False)
    ds = open_dataset(res.output)
    assert os.fsdecode(b"cl\xffass") in ds.classes
    assert bytes(ds.read_payload(ds.index_of(os.fsdecode(b"class_0/bad\xff.jpg")))) == good
    report = json.loads((res.output / "errors.json").read_text(encoding="utf-8"))
    assert [e["path"] for e in report["errors"]] == [os.fsdecode(b"class_1/junk\xff.jpg")]
    assert verify(res.output, against=src).ok

    back = tmp_path / "back"
    res = run_cli("extract", tmp_path / "o.lmdb", back, "-q")
    assert res.returncode == 0, res.stderr
    with open(os.fsencode(back) + b"/class_0/bad\xff.jpg", "rb") as fh:
        assert fh.read() == good
    assert os.listdir(os.fsencode(back) + b"/cl\xffass") == [b"p\xfe.jpg"]
