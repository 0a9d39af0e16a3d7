"""Reading per-sample fields: fields= shapes, ds.field, DataLoader workers (fork, spawn), conversions that carry
fields byte for byte, extract's sidecar, info, and crafted field files refused with a PackerError."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.fielded import SPECS, same_value, write_fielded
from support.fuzzing import _rewrite_checksums
from support.spawned import Fetch, batches_of, probe_for

from packer.errors import PackerError
from packer.read.collate import collate
from packer.read.dataset import open_dataset
from packer.tools.extract import FIELDS_NAME, extract
from packer.tools.info import dataset_info, info_rows
from packer.tools.verify import verify
from packer.write.convert import convert


@pytest.fixture(scope="module")
def fielded(tmp_path_factory):
    out = tmp_path_factory.mktemp("fields") / "f.lmdb"
    return out, write_fielded(out, "lmdb", count=9)


def test_default_tuple_and_dict_shapes(fielded):
    path, samples = fielded
    plain = open_dataset(path, image="numpy")
    img, label = plain[4]
    assert label == samples[4]["label"] and img.ndim == 3
    ds = open_dataset(path, fields=("boxes", "label", "caption"))
    boxes, label, caption = ds[4]
    assert same_value(boxes, samples[4]["boxes"]) and caption == samples[4]["caption"]
    every = open_dataset(path, fields="all", image="numpy")[4]
    assert list(every) == ["image", "label", *SPECS]
    with pytest.raises(PackerError, match="no field 'nope'"):
        open_dataset(path, fields=("image", "nope"))
    with pytest.raises(KeyError, match="no field 'nope'"):
        plain.field("nope", 0)
    with pytest.raises(IndexError):
        plain.field("caption", len(plain))


def test_shuffled_conversion_carries_fields_by_public_index(fielded, tmp_path):
    path, samples = fielded
    out = tmp_path / "shuffled.hdf5"
    convert(path, out, to="hdf5", order="shuffled", seed=3, progress=False, workers=0)
    ds = open_dataset(out, fields="all", image="numpy")
    assert not ds.index_map.identity  # stored in another order: field() must map the index
    assert ds.field_specs == SPECS
    for i, want in enumerate(samples):
        for name in SPECS:
            assert same_value(ds.field(name, i), want[name])
            assert same_value(ds[i][name], want[name])
    assert verify(out, against=path).ok
    caption = np.load(out / FIELDS / "caption.blob.npy")
    caption[0] ^= 1  # one byte of one caption changed, checksums made to agree: only the comparison finds it
    np.save(out / FIELDS / "caption.blob.npy", caption)
    _rewrite_checksums(out)
    report = verify(out, against=path)
    assert not report.ok and any("field 'caption' differs" in p for p in report.problems)


def _field_files(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((root / "meta" / "fields").iterdir())}


@pytest.mark.parametrize("other", ["memmap", "recordio", "safetensors"])
def test_packed_round_trip_keeps_payloads_and_fields_byte_identical(fielded, tmp_path, other):
    path, _ = fielded
    there, back = tmp_path / f"x.{other}", tmp_path / "back.lmdb"
    convert(path, there, to=other, order="source", progress=False, workers=0)
    convert(there, back, to="lmdb", order="source", progress=False, workers=0)
    a, b = open_dataset(path), open_dataset(back)
    assert [bytes(a.read_payload(i)) for i in range(len(a))] == [bytes(b.read_payload(i)) for i in range(len(b))]
    assert _field_files(back) == _field_files(path) == _field_files(there)


FIELD_NAMES = ("image", "label", "boxes", "caption", "count")


def _check_batches(batches, samples: list) -> None:
    seen = 0
    for images, labels, boxes, captions, counts in batches:
        for k in range(len(labels)):
            want = samples[seen + k]
            assert int(labels[k]) == want["label"] and captions[k] == want["caption"]
            assert np.array_equal(np.asarray(boxes[k]), want["boxes"]) and int(counts[k]) == want["count"]
            assert tuple(images[k].shape[1:]) == (20 + (seen + k) % 5, 28 + (seen + k) % 3)
        seen += len(labels)
    assert seen == len(samples)


def test_workers_fork(fielded):
    path, samples = fielded
    ds = open_dataset(path, image="tensor", fields=FIELD_NAMES)
    _check_batches(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork",
                                               collate_fn=collate), samples)


def test_workers_spawn(spawned):
    _check_batches(spawned.values(), spawned.context)


@probe_for(test_workers_spawn)
def _spawned_fields(tmp_path_factory):
    """Batches of 4 of every field, collated by packer.collate in the spawned workers."""
    out = tmp_path_factory.mktemp("fields") / "f.lmdb"
    samples = write_fielded(out, "lmdb", count=9)
    ds = open_dataset(out, image="tensor", fields=FIELD_NAMES)
    return Fetch(ds, batches_of(len(ds), 4), collate), samples


def test_extract_writes_the_fields_beside_the_files(fielded, tmp_path):
    path, samples = fielded
    result = extract(path, tmp_path / "out")
    assert result.fields_file == tmp_path / "out" / FIELDS_NAME
    lines = [json.loads(line) for line in result.fields_file.read_text(encoding="utf-8").splitlines()]
    assert [r["path"] for r in lines] == [f"{i:09d}" for i in range(len(samples))]
    assert lines[5]["caption"] == samples[5]["caption"] and lines[5]["boxes"] == samples[5]["boxes"].tolist()
    assert base64.b64decode(lines[5]["blob"]) == samples[5]["blob"] and lines[5]["meta"] == samples[5]["meta"]


def test_info_lists_the_fields(fielded):
    path, _ = fielded
    data = dataset_info(path)
    assert data["fields"] == SPECS
    assert ("fields", ", ".join(f"{k}: {v}" for k, v in SPECS.items())) in info_rows(path, data)


# ------------------------------------------------------------------ crafted field files


def _craft(src: Path, dst: Path, edit) -> Path:
    import shutil

    shutil.copytree(src, dst)
    edit(dst)
    _rewrite_checksums(dst)
    return dst


def _save(path: Path, arr: np.ndarray) -> None:
    np.save(path, arr)


def _manifest_fields(value):
    def edit(root: Path) -> None:
        m = json.loads((root / "manifest.json").read_text())
        m["fields"] = value
        (root / "manifest.json").write_text(json.dumps(m))
    return edit


FIELDS = "meta/fields"
CRAFTED = {
    "decreasing offsets": lambda r: _save(r / FIELDS / "caption.offsets.npy",
                                          np.load(r / FIELDS / "caption.offsets.npy")[::-1].copy()),
    "offsets past the blob": lambda r: _save(r / FIELDS / "boxes.offsets.npy",
                                             np.load(r / FIELDS / "boxes.offsets.npy") * 1000),
    "wrong dtype": lambda r: _save(r / FIELDS / "count.npy", np.load(r / FIELDS / "count.npy").astype("<f8")),
    "too few values": lambda r: _save(r / FIELDS / "mask.npy", np.load(r / FIELDS / "mask.npy")[:3]),
    "blob rows of another shape": lambda r: _save(r / FIELDS / "boxes.blob.npy",
                                                  np.zeros((3, 5), np.float32)),
    "huge header": lambda r: (r / FIELDS / "caption.blob.npy").write_bytes(
        b"\x93NUMPY\x01\x00v\x00{'descr': '|u1', 'fortran_order': False, 'shape': (99999999999999,), }"
        + b" " * 51 + b"\n"),
    "pickled object array": lambda r: np.save(r / FIELDS / "count.npy", np.array([{}] * 9, dtype=object),
                                              allow_pickle=True),
    "missing file": lambda r: (r / FIELDS / "score.npy").unlink(),
    "unknown spec": _manifest_fields({**SPECS, "caption": "object"}),
    "huge spec": _manifest_fields({**SPECS, "mask": "uint8[65536,65536]"}),
    "name leaving meta": _manifest_fields({"../../manifest": "int"}),
    "spec of another type": _manifest_fields({"caption": 5}),
    "undeclared files declared": _manifest_fields({**SPECS, "ghost": "int"}),
}


@pytest.mark.parametrize("kind", sorted(CRAFTED))
def test_crafted_field_files_are_refused_on_open(fielded, tmp_path, kind):
    path, _ = fielded
    bad = _craft(path, tmp_path / "bad.lmdb", CRAFTED[kind])
    with pytest.raises(PackerError):
        open_dataset(bad)


@pytest.mark.parametrize("name, blob", [("meta", b"{not json"), ("caption", b"\xff\xfe")])
def test_damaged_text_is_a_packer_error_when_read(fielded, tmp_path, name, blob):
    path, _ = fielded

    def edit(root: Path) -> None:
        offsets = np.load(root / FIELDS / f"{name}.offsets.npy")
        offsets[1:] = len(blob)  # sample 0 holds the crafted bytes, the others nothing
        _save(root / FIELDS / f"{name}.offsets.npy", offsets)
        _save(root / FIELDS / f"{name}.blob.npy", np.frombuffer(blob, np.uint8).copy())

    ds = open_dataset(_craft(path, tmp_path / "t.lmdb", edit))
    with pytest.raises(PackerError, match="damaged"):
        ds.field(name, 0)
