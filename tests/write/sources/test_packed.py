"""A packer dataset as a source: any format into any other and back, --classes, --split."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from packer import FORMATS, PackerError, convert, open_dataset
from packer.tools.verify import verify
from packer.write.convert import convert_split
from tests.support.cli import run_cli
from tests.support.imagesets import make_imagefolder

RAW_OPTIONS = {"mosaic": {"tile": "24x32"}, "memmap": {}}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    imgs = make_imagefolder(tmp_path_factory.mktemp("p") / "imgs", classes=4, per_class=5)
    return convert(imgs, imgs.with_name("imgs.lmdb"), shard_bytes=8_000, workers=0, progress=False).output



def _pairs(ds):
    """(key, label) of every sample: relative keys, whatever ``samples`` joins them with."""
    return list(zip(ds.relpaths, ds.targets))

def _payloads(path: Path) -> dict[str, bytes]:
    ds = open_dataset(path)
    return {rel: bytes(np.ascontiguousarray(ds.read_payload(i)).tobytes() if ds.manifest.payload == "raw"
                       else ds.read_payload(i)) for i, rel in enumerate(ds.index.rel_paths())}


@pytest.mark.parametrize("fmt", sorted(n for n, f in FORMATS.items() if "encoded" in f.payloads and n != "lmdb"))
def test_encoded_payloads_move_as_bytes_there_and_back(src, tmp_path, fmt):
    there = convert(src, tmp_path / f"x.{fmt}", to=fmt, workers=0, progress=False).output
    back = convert(there, tmp_path / "back.lmdb", workers=0, progress=False).output
    original = _payloads(src)
    assert _payloads(there) == original and _payloads(back) == original
    ds = open_dataset(back)
    assert ds.classes == open_dataset(src).classes and sorted(_pairs(ds)) == sorted(_pairs(open_dataset(src)))
    assert open_dataset(there).manifest.source_type == "packed"
    assert verify(there, against=src).ok and verify(back, against=there).ok


@pytest.mark.parametrize("fmt", ["bmp", "mosaic", "memmap", "hdf5"])
def test_raw_pixels_move_unchanged_there_and_back(src, tmp_path, fmt):
    raw = convert(src, tmp_path / "raw.lmdb", payload="raw", resize="24x32", workers=0, progress=False).output
    there = convert(raw, tmp_path / f"x.{fmt}", to=fmt, payload="raw", workers=0, progress=False,
                    **RAW_OPTIONS.get(fmt, {})).output
    back = convert(there, tmp_path / "back.lmdb", payload="raw", workers=0, progress=False).output
    assert _payloads(back) == _payloads(raw)
    assert verify(there, against=raw).ok
    with pytest.raises(PackerError, match="never re-encodes: convert it with payload='raw'"):
        convert(raw, tmp_path / "enc.lmdb", workers=0, progress=False)


def test_classes_subset_is_renumbered_like_imagefolder(src, tmp_path):
    out = convert(src, tmp_path / "s.hdf5", to="hdf5", classes="class_3,class_1", workers=0, progress=False).output
    ds, full = open_dataset(out), open_dataset(src)
    assert ds.classes == ["class_1", "class_3"]  # what ImageFolder gives for a folder of only these two
    want = sorted((rel, ["class_1", "class_3"].index(full.classes[t])) for rel, t in _pairs(full)
                  if full.classes[t] in ("class_1", "class_3"))
    assert sorted(_pairs(ds)) == want
    assert verify(out, against=src).ok  # the recorded --classes is applied to the source again
    with pytest.raises(PackerError, match="classes: nope not among the source's classes"):
        convert(src, tmp_path / "t.hdf5", to="hdf5", classes=["nope"], workers=0, progress=False)


def _digest(path: Path) -> str:
    manifest = json.loads((path / "manifest.json").read_text())
    return hashlib.sha256(json.dumps([[f["sha256"] for f in s["files"]] for s in manifest["shards"]]).encode()
                          + json.dumps([f["sha256"] for f in manifest["meta_files"]]).encode()).hexdigest()


def test_split_is_stratified_seeded_and_reproducible(src, tmp_path):
    train, val = convert_split(src, tmp_path / "a.lmdb", split=0.6, seed=3, workers=0, progress=False)
    assert train.output.name == "a.lmdb-train" and val.output.name == "a.lmdb-val"
    tr, va = open_dataset(train.output), open_dataset(val.output)
    assert np.array_equal(np.bincount(tr.targets), [3] * 4) and np.array_equal(np.bincount(va.targets), [2] * 4)
    assert not {r for r, _ in _pairs(tr)} & {r for r, _ in _pairs(va)}
    assert len(tr) + len(va) == len(open_dataset(src))
    again = convert_split(src, tmp_path / "b.lmdb", split=0.6, seed=3, workers=2, progress=False)
    assert _digest(again[0].output) == _digest(train.output) and _digest(again[1].output) == _digest(val.output)
    other = convert_split(src, tmp_path / "c.lmdb", split=0.6, seed=4, workers=0, progress=False)
    assert {r for r, _ in _pairs(open_dataset(other[0].output))} != {r for r, _ in _pairs(tr)}
    assert verify(train.output, against=src).ok and verify(val.output, against=src).ok


def test_cli_split_and_classes(src, tmp_path):
    proc = run_cli("convert", src, "--to", "pth", "--classes", "class_0,class_2", "--split", "0.8", "--seed", "1",
                   "-o", tmp_path / "o", "-q")
    assert proc.returncode == 0, proc.stderr
    tr, va = open_dataset(tmp_path / "o-train"), open_dataset(tmp_path / "o-val")
    assert tr.classes == va.classes == ["class_0", "class_2"] and (len(tr), len(va)) == (8, 2)
    assert run_cli("verify", tmp_path / "o-val", "--against", src, "-q").returncode == 0


def test_a_crafted_class_name_is_refused_when_re_packed(src, tmp_path):
    """A dataset edited to name a class ``../evil`` (the manifest has no checksum) is no source: refused before
    anything is written, naming the class."""
    import shutil

    ds = tmp_path / "ds.lmdb"
    shutil.copytree(src, ds)
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["classes"][2] = "../evil"
    (ds / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackerError, match=r"class 2: class name '\.\./evil' holds a path separator"):
        convert(ds, tmp_path / "out.hdf5", to="hdf5", workers=0, progress=False)
    assert not (tmp_path / "out.hdf5").exists() and not (tmp_path / "out.hdf5.partial").exists()
