"""A packer dataset as a source: any format into any other and back, --classes, --split."""

from __future__ import annotations

import hashlib
import json
import shutil
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


DAMAGE = [("lmdb", "encoded", "encoded"), ("lmdb", "encoded", "raw"), ("lmdb", "raw", "raw"),
          ("memmap", "encoded", "encoded"), ("memmap", "encoded", "raw"), ("hdf5", "raw", "raw")]


def _damaged_source(tmp_path: Path, fmt: str, payload: str) -> tuple[Path, int, list[str]]:
    """A dataset of ``fmt`` in several shards, 2,048 bytes zeroed inside a sample of shard 1 (its manifest left as it
    was: ``packer verify`` fails it); the shard and the keys of every sample stored in it."""
    imgs = make_imagefolder(tmp_path / "imgs", classes=3, per_class=8, size=(48, 64))
    src = convert(imgs, tmp_path / f"src.{fmt}", to=fmt, payload=payload,
                  shard_bytes=20_000 if payload == "encoded" else 40_000, workers=0, progress=False).output
    ds = open_dataset(src)
    assert len(ds.manifest.shards) >= 3
    start = int(ds.store.starts[1])
    keys = [ds.index.rel_path(start + k) for k in range(ds.manifest.shards[1].num_samples)]
    path, lo, _hi = ds.store.readers[1].file_spans([0])[0][-1]  # inside its first sample's bytes
    ds.close()
    with open(path, "r+b") as fh:
        fh.seek(lo + 16)
        fh.write(bytes(2048))
    assert not verify(src).ok
    return src, 1, keys


@pytest.mark.parametrize("fmt,payload,out_payload", DAMAGE, ids=["-".join(c) for c in DAMAGE])
def test_a_damaged_shard_is_never_copied_clean(tmp_path, fmt, payload, out_payload):
    """Every sample of the shard failing its checksum is an errors.json entry naming the shard and the reason (none
    of them packed, the one zeroed or the others); the other shards convert as before; verify against the damaged
    source fails. Before: the copy got fresh checksums and verify passed with a damaged sample inside."""
    src, shard, keys = _damaged_source(tmp_path, fmt, payload)
    shard_file = open_dataset(src).manifest.shards[shard].files[0].name
    workers = 2 if out_payload == "raw" else 0  # the check runs in pool workers too
    res = convert(src, tmp_path / "re.hdf5", to="hdf5" if fmt != "hdf5" else "lmdb", payload=out_payload,
                  workers=workers, progress=False)
    errors = json.loads((res.output / "errors.json").read_text())["errors"]
    assert sorted(e["path"] for e in errors) == sorted(keys)
    assert all(f"{src / shard_file}: checksum mismatch" in e["reason"] and f"shard {shard} of the source dataset "
               "is damaged" in e["reason"] and e["location"].startswith(f"{src.name}: sample ") for e in errors)
    out, original = open_dataset(res.output), open_dataset(src)
    assert len(out) == len(original) - len(keys) and not set(out.relpaths) & set(keys)
    if out_payload == payload:  # the undamaged shards' samples, byte for byte
        def payloads(ds):
            return {rel: np.ascontiguousarray(ds.read_payload(i)).tobytes() for i, rel in enumerate(ds.relpaths)}

        assert payloads(out) == {k: v for k, v in payloads(original).items() if k not in keys}
    report = verify(res.output, against=src)
    assert not report.ok and f"the source is damaged: {src / shard_file}: checksum mismatch" in report.problems[0]
    assert run_cli("verify", res.output, "--against", src, "-q").returncode == 1


def test_verify_of_a_clean_copy_made_from_a_damaged_source_fails(tmp_path):
    """The laundered copy of before (fresh checksums over a damaged sample) fails ``verify --against`` the source:
    the source is checked against its own manifest, not only compared with."""
    from support.fuzzing import _rewrite_checksums

    src, _shard, _keys = _damaged_source(tmp_path, "lmdb", "raw")
    laundered = tmp_path / "laundered.lmdb"
    shutil.copytree(src, laundered)
    _rewrite_checksums(laundered)  # what the old conversion's copy amounted to: the damage with checksums to match
    copy = convert(laundered, tmp_path / "copy.hdf5", to="hdf5", payload="raw", workers=0, progress=False).output
    assert verify(copy, against=laundered).ok  # against the source it was made from: a faithful copy
    report = verify(copy, against=src)
    assert not report.ok and "the source is damaged" in report.problems[0]
