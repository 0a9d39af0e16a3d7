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
import packer.write.writer as wr
record = wr.record_shard
def killing(partial, result, names):
    out = record(partial, result, names)
    if result.shard_id == int(sys.argv[2]):
        os._exit(9)  # killed right after the shard was journaled: no clean-up of any kind
    return out
wr.record_shard = killing
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
