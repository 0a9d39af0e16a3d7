"""Crafted and damaged datasets get PackerError (one hostile input per test), verify --deep, extract."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.fuzzing import _rewrite_checksums as recompute_checksums
from support.fuzzing import craft_rel_path
from support.fuzzing import put_sample_value as put_value

from packer import PackerError, convert, open_dataset
from packer.cli import main
from packer.images.decode import DecodeError
from packer.layout.trust import load_npy
from packer.tools.extract import extract
from packer.tools.verify import verify

PACKER = Path(__file__).resolve().parents[2] / "packer"


@pytest.fixture(scope="module")
def bases(imagefolder, tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    out = {}
    for payload in ("encoded", "raw"):
        out[payload] = root / f"{payload}.lmdb"
        convert(imagefolder, out[payload], to="lmdb", payload=payload, shard_bytes=6_000, workers=1, progress=False)
    return out


@pytest.fixture
def enc(bases, tmp_path):
    shutil.copytree(bases["encoded"], tmp_path / "ds")
    return tmp_path / "ds"


def read_all(path) -> None:
    ds = open_dataset(path, image="numpy")
    for i in range(len(ds)):
        ds[i]


def edit_manifest(ds: Path, fn) -> None:
    data = json.loads((ds / "manifest.json").read_text())
    fn(data)
    (ds / "manifest.json").write_text(json.dumps(data))


# ------------------------------------------------------------------ no pickle


def test_no_pickle_anywhere_in_packer():
    for path in PACKER.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(import pickle|from pickle|import dill|import cloudpickle)", text, re.M), path
        assert "allow_pickle=True" not in text and "pickle.load" not in text, path


def test_object_npy_is_refused_not_unpickled(enc):
    arr = np.array([{"x": 1}] * 15, dtype=object)
    np.save(enc / "meta/labels.npy", arr, allow_pickle=True)
    recompute_checksums(enc)
    with pytest.raises(PackerError, match="labels.npy"):
        open_dataset(enc)


# ------------------------------------------------------------------ manifest


@pytest.mark.parametrize("edit", [
    lambda d: d.update(num_samples="15"),
    lambda d: d.update(num_samples=True),
    lambda d: d.update(num_samples=1.5e1),
    lambda d: d.update(num_samples=-1),
    lambda d: d.update(shards={"a": 1}),
    lambda d: d["shards"][0].update(num_samples=2**70),
    lambda d: d["shards"][0]["files"][0].update(num_bytes=-5),
    lambda d: d["shards"][0]["files"][0].update(sha256=None),
    lambda d: d.update(classes=[1, 2, 3]),
    lambda d: d.update(classes=["a", "a", "b"]),
    lambda d: d["shards"][1].update(files=d["shards"][0]["files"]),
    lambda d: d["shards"][0].update(facts=[]),
], ids=["count-str", "count-bool", "count-float", "count-neg", "shards-dict", "huge", "neg-bytes", "sha-none",
        "class-int", "class-dup", "file-twice", "facts-list"])
def test_malformed_manifest_fields(enc, edit):
    edit_manifest(enc, edit)
    with pytest.raises(PackerError, match="manifest"):
        open_dataset(enc)


def test_manifest_not_an_object(enc):
    (enc / "manifest.json").write_text("[1, 2]")
    with pytest.raises(PackerError, match="not a packer manifest"):
        open_dataset(enc)


def test_a_manifest_listing_more_files_than_the_dataset_holds_is_refused_before_any_per_shard_work(enc):
    """100,000 crafted shards (a million took 84 s to reject: each entry parsed, checked and stat'ed) are refused by
    counting: the last entry's malformed checksum is never reached, so no entry was parsed before the refusal."""
    template = json.loads((enc / "manifest.json").read_text())["shards"][0]

    def crafted(d):
        d["shards"] = [{**template, "num_samples": 0, "files": [{**template["files"][0], "name": f"s{i:06d}.lmdb"}]}
                       for i in range(100_000)]
        d["shards"][0]["num_samples"] = d["num_samples"]
        d["shards"][-1]["files"][0]["sha256"] = "not a digest"  # what parsing every entry would stop at

    edit_manifest(enc, crafted)
    held = sum(1 for p in enc.rglob("*") if p.is_file())
    listed = f"{100_000 + len(json.loads((enc / 'manifest.json').read_text())['meta_files']):,}"  # shards + meta/
    for attempt in (lambda: open_dataset(enc), lambda: convert(enc, enc.parent / "copy.hdf5", to="hdf5")):
        with pytest.raises(PackerError) as err:
            attempt()
        assert f"lists {listed} files in 100,000 shards, but the dataset folder holds {held} files" in str(err.value)
    assert f"lists {listed} files" in verify(enc).problems[0]
    assert main(["info", str(enc)]) == 1


def test_a_shard_listing_no_files_is_refused_before_the_rest_is_parsed(enc):
    def crafted(d):
        d["shards"][0]["files"] = []
        d["shards"][-1]["files"][0]["sha256"] = "not a digest"  # never reached

    edit_manifest(enc, crafted)
    with pytest.raises(PackerError, match="a shard lists no files"):
        open_dataset(enc)


@pytest.mark.parametrize("name", ["../outside.lmdb", "/etc/passwd", "meta/../../x", "a\\..\\b", "", "x\x00y"])
def test_shard_names_leaving_the_directory(enc, name):
    edit_manifest(enc, lambda d: d["shards"][0]["files"][0].update(name=name))
    with pytest.raises(PackerError, match="outside|plain relative"):
        open_dataset(enc)
    assert not verify(enc).ok


@pytest.mark.parametrize("what", ["shard", "meta-file", "meta-dir", "manifest"])
def test_symlinks_out_of_the_dataset_are_refused(enc, tmp_path, what):
    outside = tmp_path / "outside"
    shutil.copytree(enc, outside)  # identical content: only the path check can refuse it
    name = {"shard": "shard-00000.lmdb", "meta-file": "meta/labels.npy", "meta-dir": "meta",
            "manifest": "manifest.json"}[what]
    target = enc / name
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    os.symlink(outside / name, target)
    with pytest.raises(PackerError, match="outside the dataset directory"):
        read_all(enc)
    assert not verify(enc).ok


def test_symlinks_inside_the_dataset_and_a_symlinked_dataset_are_fine(enc, tmp_path):
    (enc / "shard-00000.lmdb").rename(enc / "real-00000")
    os.symlink("real-00000", enc / "shard-00000.lmdb")
    link = tmp_path / "link.lmdb"
    os.symlink(enc, link)
    read_all(link)
    assert verify(link).ok


# ------------------------------------------------------------------ index (meta/*.npy)


def test_npy_header_promising_more_than_the_file_holds(tmp_path):
    path = tmp_path / "a.npy"
    np.save(path, np.arange(10, dtype="<i8"))
    data = path.read_bytes().replace(b"(10,)", b"(1099511627776,)".ljust(5))
    # keep the header length: rewrite it with the same padding
    header_len = struct.unpack("<H", data[8:10])[0]
    header = "{'descr': '<i8', 'fortran_order': False, 'shape': (1099511627776,), }".ljust(header_len - 1) + "\n"
    path.write_bytes(data[:10] + header.encode() + data[10 + header_len:])
    with pytest.raises(PackerError, match="header promises"):
        load_npy(path, "<i8")


@pytest.mark.parametrize("name,value,match", [
    ("labels", 3, "labels from"), ("labels", -2, "labels from"), ("heights", 2**30, "sides"),
    ("widths", -1, "negative"), ("path_offsets", 10**9, "offsets"),
])
def test_crafted_index_values(enc, name, value, match):
    arr = np.load(enc / f"meta/{name}.npy")
    arr[len(arr) // 2] = value
    np.save(enc / f"meta/{name}.npy", arr)
    recompute_checksums(enc)
    with pytest.raises(PackerError, match=match):
        open_dataset(enc)


def test_damaged_index_fails_its_checksum(enc):
    arr = np.load(enc / "meta/labels.npy")
    arr[0] = (arr[0] + 1) % 3  # a valid label, but not the one packed
    np.save(enc / "meta/labels.npy", arr)
    with pytest.raises(PackerError, match="checksum"):
        open_dataset(enc)


# ------------------------------------------------------------------ shards


def test_truncated_lmdb_shard_with_matching_manifest_raises_not_sigbus(enc):
    shard = enc / "shard-00000.lmdb"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    recompute_checksums(enc)
    with pytest.raises(PackerError, match="truncated"):
        read_all(enc)


def test_samples_moved_between_shards_are_caught(enc):
    def move(d):
        d["shards"][0]["num_samples"] -= 1
        d["shards"][1]["num_samples"] += 1
    edit_manifest(enc, move)
    with pytest.raises(PackerError, match="holds"):
        read_all(enc)


def test_value_length_disagreeing_with_the_index(enc):
    nbytes = np.load(enc / "meta/nbytes.npy")
    nbytes[4] += 1
    np.save(enc / "meta/nbytes.npy", nbytes)
    recompute_checksums(enc)
    ds = open_dataset(enc)
    with pytest.raises(PackerError, match="the index says"):
        ds[ds.index_map.public(4)]  # the sample stored at 4
    ds[ds.index_map.public(3)]  # the others still read


def test_garbage_jpeg_bytes_raise_decode_error(enc):
    rng = np.random.default_rng(0)
    put_value(enc, 2, b"\xff\xd8\xff\xe0" + rng.bytes(3000))
    ds = open_dataset(enc)
    with pytest.raises(DecodeError, match="sample 2"):
        ds[2]
    for backend in ("pil", "turbojpeg"):
        with pytest.raises(DecodeError):
            open_dataset(enc, decoder=backend)[2]


def test_jpeg_header_claiming_a_huge_image_is_refused_before_decoding(enc):
    ds = open_dataset(enc)
    data = bytearray(ds.read_payload(5))
    ds.close()
    sof = next(i for i in range(2, len(data) - 9) if data[i] == 0xFF and data[i + 1] in (0xC0, 0xC2))
    data[sof + 5: sof + 9] = struct.pack(">HH", 60000, 60000)  # 10.8 GB of pixels once decoded
    put_value(enc, 5, bytes(data))
    with pytest.raises(DecodeError, match="header says 60000x60000"):
        open_dataset(enc, image="numpy")[5]


# ------------------------------------------------------------------ verify --deep


def test_verify_deep_decodes_what_checksums_cannot_judge(enc, capsys):
    ds = open_dataset(enc)
    data = bytes(ds.read_payload(7))
    ds.close()
    put_value(enc, 7, data[: len(data) // 2] + bytes(len(data) - len(data) // 2))  # truncated JPEG, zero-padded
    assert verify(enc).ok  # the crafted checksums agree
    report = verify(enc, deep=True)
    assert not report.ok and "sample 7" in report.problems[0]
    assert main(["verify", str(enc), "--deep", "-q"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_verify_deep_passes_good_datasets(bases, capsys):
    for path in bases.values():
        report = verify(path, deep=True)
        assert report.ok and report.checked["decoded"] == 15
        assert main(["verify", str(path), "--deep", "-q"]) == 0


# ------------------------------------------------------------------ extract


def test_extract_encoded_is_byte_identical(bases, imagefolder, tmp_path, capsys):
    out = tmp_path / "restored"
    assert main(["extract", str(bases["encoded"]), str(out), "-q"]) == 0
    src = sorted(p.relative_to(imagefolder) for p in imagefolder.rglob("*") if p.is_file())
    got = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert got == src
    for rel in src:
        assert (out / rel).read_bytes() == (imagefolder / rel).read_bytes()


def test_extract_raw_writes_png_with_the_stored_pixels(bases, tmp_path, capsys):
    out = tmp_path / "restored"
    assert main(["extract", str(bases["raw"]), str(out), "-q"]) == 0
    assert "PNG" in capsys.readouterr().out
    ds = open_dataset(bases["raw"], image="numpy")
    for i, rel in enumerate(ds.relpaths):
        png = out / Path(rel).with_suffix(".png")
        assert np.array_equal(np.asarray(Image.open(png).convert("RGB")), ds[i][0])
    assert not list(out.rglob("*.jpg"))


def test_extract_refuses_existing_files_unless_overwrite(bases, tmp_path):
    out = tmp_path / "restored"
    extract(bases["encoded"], out)
    victim = next(out.rglob("*.jpg"))
    victim.write_bytes(b"mine")
    with pytest.raises(PackerError, match="exist already"):
        extract(bases["encoded"], out)
    assert victim.read_bytes() == b"mine"
    assert main(["extract", str(bases["encoded"]), str(out), "-q"]) == 2
    extract(bases["encoded"], out, overwrite=True)
    assert victim.read_bytes() != b"mine"


@pytest.mark.parametrize("evil", ["../evil.jpg", "/tmp/evil-packer.jpg", "class_0/../../evil.jpg", "./x.jpg"])
def test_extract_refuses_paths_leaving_the_destination(enc, tmp_path, evil):
    craft_rel_path(enc, 3, evil)
    out = tmp_path / "deep" / "restored"
    with pytest.raises(PackerError):
        extract(enc, out)
    assert not (tmp_path / "deep" / "evil.jpg").exists() and not Path("/tmp/evil-packer.jpg").exists()
    assert not out.exists() or not any(out.rglob("*.jpg"))  # refused before writing anything


def test_extract_refuses_a_symlink_in_the_destination_leading_out(bases, tmp_path):
    out, elsewhere = tmp_path / "restored", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, out / "class_1")
    with pytest.raises(PackerError, match="outside"):
        extract(bases["encoded"], out, overwrite=True)
    assert not any(elsewhere.iterdir())
    (out / "class_1").unlink()  # a link at the file itself, leading out: refused too, never written through
    (out / "class_0").mkdir()
    os.symlink(elsewhere / "stolen.jpg", out / "class_0" / "img_000.jpg")
    with pytest.raises(PackerError, match="outside"):
        extract(bases["encoded"], out, overwrite=True)
    assert not (elsewhere / "stolen.jpg").exists()
