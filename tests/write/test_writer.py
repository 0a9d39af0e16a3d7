"""The public Writer: every field kind in every format, validation, errors.json, resume after a kill."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.fielded import SPECS, same_value, write_fielded
from support.imagesets import jpeg_bytes
from support.memlimit import GIB, limited_call

from packer.errors import PackerError
from packer.formats import FORMATS
from packer.read.dataset import open_dataset
from packer.write.writer import Writer


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_field_kind_round_trips_in_every_format(tmp_path, fmt):
    out = tmp_path / f"d.{fmt}"
    samples = write_fielded(out, fmt)
    with open_dataset(out, fields="all", image="numpy") as ds:
        assert ds.field_specs == SPECS
        assert len(ds) == len(samples)
        for i, want in enumerate(samples):
            got = ds[i]
            assert got["label"] == want["label"]
            for name in SPECS:
                assert same_value(got[name], want[name]), (fmt, i, name)
                assert same_value(ds.field(name, i), want[name])
            if ds.manifest.payload == "encoded":
                assert bytes(ds.read_payload(i)) == want["image"]


@pytest.mark.parametrize("fmt, options", [("lmdb", {}), ("hdf5", {"compression": "gzip"})])
def test_arrays_are_stored_raw_and_labels_name_classes(tmp_path, fmt, options):
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 255, (5 + i, 7, 3), dtype=np.uint8) for i in range(4)]
    with Writer(tmp_path / "a", format=fmt, classes=["cat", "dog"], fields={"n": "int"}, **options) as w:
        for i, a in enumerate(arrays):
            w.add(a, label=i % 2, n=i)
    ds = open_dataset(tmp_path / "a", image="numpy", fields=("image", "label", "n"))
    assert ds.manifest.payload == "raw" and ds.classes == ["cat", "dog"] and ds.indexing == "imagefolder"
    for i, a in enumerate(arrays):
        img, label, n = ds[i]
        assert np.array_equal(img, a) and label == i % 2 and n == i
    assert ds.relpaths == [f"{i:09d}" for i in range(4)]


def test_a_bad_sample_names_its_number_or_goes_to_errors_json(tmp_path):
    rng = np.random.default_rng(2)
    good = jpeg_bytes(rng, 16, 16)
    with pytest.raises(PackerError, match="sample 1: .*cannot|sample 1: .*decode|sample 1: "):
        with Writer(tmp_path / "r.lmdb", fields={"n": "int"}) as w:
            w.add(good, n=0)
            w.add(b"not an image", n=1)
    assert not (tmp_path / "r.lmdb").exists()
    with Writer(tmp_path / "s.lmdb", fields={"n": "int", "t": "str"}, on_error="skip") as w:
        w.add(good, n=0, t="a")
        w.add(b"not an image", n=1, t="b")
        w.add(good, n="two", t="c")  # a bad field value is a bad sample too
        w.add(good, n=3, t="d")
    ds = open_dataset(tmp_path / "s.lmdb", fields=("n", "t"))
    assert [ds[i] for i in range(len(ds))] == [(0, "a"), (3, "d")]
    report = json.loads((tmp_path / "s.lmdb" / "errors.json").read_text())
    assert [e["path"] for e in report["errors"]] == ["000000001", "000000002"]
    assert "field 'n'" in report["errors"][1]["reason"]


@pytest.mark.parametrize("spec", ["uint8[\u00b2,3]", "uint8[\u0662]", "uint8[]", "float32[:]x", "uint8[0,3]"])
def test_odd_array_specs_are_refused_in_one_line(tmp_path, spec):
    with pytest.raises(PackerError, match="field spec|unknown field spec"):
        Writer(tmp_path / "x.lmdb", fields={"m": spec})


def test_values_that_would_change_or_overflow_are_bad_samples(tmp_path):
    """Nothing is stored other than what was given: no wrapped integers, no float overflow to inf, no label past
    what the dataset can name; each is the sample's error (here: skipped into errors.json), never a crash."""
    good = jpeg_bytes(np.random.default_rng(4), 16, 16)
    bad = [({"i8": np.array([300, 1000])}, "not every value is kept"),
           ({"i64": np.array([2**64 - 1], np.uint64)}, "not every value is kept"),
           ({"f16": np.array([1e300])}, "overflow"),
           ({"f": 10**400}, "too large for a float"),
           ({"label": 2**63}, "label"),
           ({"label": np.uint64(2**64 - 1)}, "label"),
           ({"label": 3_000_000}, "pass classes="),
           ({"label": 10**5000}, "label of 16610 bits above 1,048,575: pass classes="),  # repr() would raise
           ({"image": np.zeros((0, 0, 3), np.uint8)}, "an empty image")]
    ok = {"image": good, "label": 1, "i8": np.array([1, -2]), "i64": np.array([5]), "f16": np.array([0.5]), "f": 1.5}
    specs = {"i8": "int8[2]", "i64": "int64[1]", "f16": "float16[1]", "f": "float"}
    with Writer(tmp_path / "s.lmdb", fields=specs, on_error="skip", payload="raw") as w:
        w.add(**{**ok, "image": np.full((4, 5, 3), 9, np.uint8)})
        for change, _ in bad:
            w.add(**{**ok, "image": np.full((4, 5, 3), 9, np.uint8), **change})
    report = json.loads((tmp_path / "s.lmdb" / "errors.json").read_text())
    assert len(report["errors"]) == len(bad)
    for e, (_, why) in zip(report["errors"], bad):
        assert why in e["reason"], (e, why)
    ds = open_dataset(tmp_path / "s.lmdb", fields="all")
    assert len(ds) == 1 and ds.classes == ["0", "1"] and ds.field("i8", 0).tolist() == [1, -2]
    with pytest.raises(TypeError, match="integers"):
        ds.field("f", 0.0)
    with pytest.raises(TypeError, match="integers"):
        ds["0"]


def _add_array(out: Path, kind: str) -> str:
    """Add one 20000x20000x3 array (400 M pixels, above the limit of 2 x Pillow's 179 M) to a new Writer."""
    shape = (20000, 20000, 3)
    image = np.broadcast_to(np.zeros(3, np.uint8), shape) if kind == "zero-stride" else np.zeros(shape, np.uint8)
    try:
        with Writer(out, format="lmdb") as w:
            w.add(image, label=0)
    except PackerError as exc:
        return str(exc)
    return "added"


@pytest.mark.parametrize(("kind", "limit"), [("zero-stride", GIB // 2), ("whole", 3 * GIB // 2)])
def test_an_array_above_the_pixel_limit_is_refused_before_any_copy(tmp_path, kind, limit):
    """A 1.2 GB array (or a view of 3 bytes standing for one) was copied whole and OOM-killed the caller: the
    pixel limit applies to arrays too, before any copy. The child may grow by less than a copy would need."""
    status, message = limited_call(_add_array, tmp_path / "a.lmdb", kind, limit=limit)
    assert status == "ok", message
    assert "sample 0: image array is 20000x20000 (400000000 pixels), above the pixel limit" in str(message)
    assert not (tmp_path / "a.lmdb").exists()


@pytest.mark.parametrize("name", ["../evil", "/abs", "a/b", "nul\x00", "..", ".", "", "back\\slash"])
def test_class_names_that_are_no_folder_name_are_refused_naming_them(tmp_path, name):
    """``packer extract`` makes a folder per class: a name it can't use is refused when the Writer is made."""
    with pytest.raises(PackerError, match=r"Writer: classes\[1\]: class name .* a class name must be one plain"):
        Writer(tmp_path / "x.lmdb", classes=["ok", name])
    assert not any(tmp_path.iterdir())


def test_fields_must_be_declared_and_given(tmp_path):
    with pytest.raises(PackerError, match="not an identifier"):
        Writer(tmp_path / "x.lmdb", fields={"../x": "int"})
    with pytest.raises(PackerError, match="unknown field spec"):
        Writer(tmp_path / "x.lmdb", fields={"x": "object"})
    with pytest.raises(PackerError, match="not a field name"):
        Writer(tmp_path / "x.lmdb", fields={"label": "int"})
    good = jpeg_bytes(np.random.default_rng(3), 16, 16)
    with pytest.raises(PackerError, match="missing field"):
        with Writer(tmp_path / "x.lmdb", fields={"a": "int"}) as w:
            w.add(good)
    with pytest.raises(PackerError, match="undeclared field"):
        with Writer(tmp_path / "y.lmdb") as w:
            w.add(good, a=1)
    (tmp_path / "taken").mkdir()
    with pytest.raises(PackerError, match="not a packer dataset"):
        Writer(tmp_path / "taken")


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "manifest.json"}


def _manifest(root: Path) -> dict:
    data = json.loads((root / "manifest.json").read_text())
    data.pop("created_at")
    return data


KILL = """
import os, sys
sys.path.insert(0, sys.argv[3])
from support.fielded import write_fielded
from packer.write.output import Output
record = Output.shard_done
def killing(output, result, names):
    out = record(output, result, names)
    if result.shard_id == int(sys.argv[2]):
        os._exit(9)  # killed right after the shard was journaled: no clean-up of any kind
    return out
Output.shard_done = killing
write_fielded(sys.argv[1], "lmdb", count=12, shard_bytes=2000)
"""


def test_resume_after_a_kill_is_byte_identical(tmp_path):
    whole = tmp_path / "whole.lmdb"
    write_fielded(whole, "lmdb", count=12, shard_bytes=2000)
    assert len(_manifest(whole)["shards"]) >= 4
    resumed = tmp_path / "resumed.lmdb"
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), tests])}
    run = subprocess.run([sys.executable, "-c", KILL, str(resumed), "1", tests], env=env, capture_output=True)
    assert run.returncode == 9, run.stderr.decode()
    partial = tmp_path / "resumed.lmdb.partial"
    assert partial.is_dir() and not resumed.exists()
    with pytest.raises(PackerError, match="resume=True"):
        write_fielded(resumed, "lmdb", count=12, shard_bytes=2000)
    write_fielded(resumed, "lmdb", count=12, shard_bytes=2000, resume=True)
    assert not partial.exists()
    assert _tree(resumed) == _tree(whole)
    assert _manifest(resumed) == _manifest(whole)


def test_an_interrupted_with_block_leaves_a_resumable_partial(tmp_path):
    out = tmp_path / "i.hdf5"
    with pytest.raises(KeyboardInterrupt):
        write_fielded(out, "hdf5", count=10, stop_after=6, shard_bytes=1500)
    assert (tmp_path / "i.hdf5.partial").is_dir()
    with pytest.raises(PackerError, match="other options"):
        write_fielded(out, "hdf5", count=10, shard_bytes=3000, resume=True)
    samples = write_fielded(out, "hdf5", count=10, shard_bytes=1500, resume=True)
    ds = open_dataset(out, fields=("caption",))
    assert [ds[i][0] for i in range(len(ds))] == [s["caption"] for s in samples]
