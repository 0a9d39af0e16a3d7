"""MXNet RecordIO as a source: packer's own ``--to recordio`` output and files written in the test
by an independent writer following ``MXIndexedRecordIO``'s layout."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from support.cli import run_cli
from support.foreign import items, write_mxnet_rec
from support.memlimit import limited_convert

from packer import convert, open_dataset

ITEMS = items(8)


def convert_ok(src: Path, out: Path, *args: object) -> dict:
    res = run_cli("convert", src, "--to", "lmdb", "-o", out, "--workers", "1", "--order", "source", *args)
    report = json.loads((out / "errors.json").read_text())
    assert res.returncode == (1 if report["num_errors"] else 0), res.stderr  # 1: some records not packed
    return report


def test_packers_records_convert_and_come_back_byte_identical(imagefolder, tmp_path):
    first = tmp_path / "a.recordio"
    convert(imagefolder, first, to="recordio", workers=0, progress=False)
    out = tmp_path / "b.lmdb"
    assert convert_ok(first / "shard-00000.rec", out)["num_errors"] == 0
    ds, orig = open_dataset(out), open_dataset(first)
    # ds[i] is the .rec's record i: orig's i-th stored sample
    assert ds.targets == orig.index.labels.tolist() and ds.classes == ["0", "1", "2"]
    assert ds.relpaths == [f"shard-00000.rec/{i}" for i in range(len(orig))]
    res = run_cli("verify", out, "--against", first / "shard-00000.rec")
    assert res.returncode == 0, res.stdout + res.stderr
    back = tmp_path / "c.recordio"
    convert(out, back, to="recordio", workers=0, progress=False, order="source")
    for name in ("shard-00000.rec", "shard-00000.idx"):
        assert (back / name).read_bytes() == (first / name).read_bytes()


@pytest.mark.parametrize("index", [True, False], ids=["idx", "walk"])
def test_an_independently_written_rec_converts_with_its_keys_and_labels(tmp_path, index):
    rec = tmp_path / "data.rec"
    ids = [100 + 3 * i for i in range(len(ITEMS))]
    write_mxnet_rec(rec, [(it.image, float(it.label), i) for it, i in zip(ITEMS, ids)],
                    keys=[f"k{i}" for i in ids], index=index)
    out = tmp_path / "out.lmdb"
    assert convert_ok(rec, out)["num_errors"] == 0
    ds = open_dataset(out)
    assert [bytes(ds.read_payload(i)) for i in range(len(ds))] == [it.image for it in ITEMS]
    assert ds.targets == [it.label for it in ITEMS]
    keys = [f"k{i}" for i in ids] if index else [str(i) for i in ids]  # the idx key, else the IRHeader id
    assert list(ds.index.rel_paths()) == [f"data.rec/{k}" for k in keys]
    res = run_cli("verify", out, "--against", rec)
    assert res.returncode == 0, res.stdout + res.stderr


def test_labels_that_are_no_class_index_are_errors_with_their_record(tmp_path):
    rec = tmp_path / "data.rec"
    labels = [1.0, 2.5, [0.0, 1.0], [2.0], float("nan"), 0.0]
    offsets = write_mxnet_rec(rec, [(ITEMS[i].image, lab, i) for i, lab in enumerate(labels)])
    report = convert_ok(rec, tmp_path / "out.lmdb")
    reasons = {e["path"]: (e["reason"], e["location"]) for e in report["errors"]}
    assert set(reasons) == {"data.rec/1", "data.rec/2", "data.rec/4"}
    assert "2.5 is not an integer" in reasons["data.rec/1"][0]
    assert "label vector of 2 values" in reasons["data.rec/2"][0]
    assert reasons["data.rec/2"][1] == f"data.rec: record at byte {offsets[2]}"
    assert open_dataset(tmp_path / "out.lmdb").targets == [1, 2, 0]  # a vector of one value is that value


def test_crafted_record_lengths_become_errors_or_one_clear_line(tmp_path):
    rec = tmp_path / "data.rec"
    offsets = write_mxnet_rec(rec, [(it.image, float(it.label), i) for i, it in enumerate(ITEMS[:4])], index=False)
    data = bytearray(rec.read_bytes())
    struct.pack_into("<I", data, offsets[2] + 4, (1 << 29) - 1)  # record 2 claims 512 MB
    rec.write_bytes(bytes(data))
    report = convert_ok(rec, tmp_path / "walk.lmdb")  # the walk stops at record 2: records 0 and 1 stand
    assert open_dataset(tmp_path / "walk.lmdb").targets == [it.label for it in ITEMS[:2]]
    assert [e["path"] for e in report["errors"]] == ["data.rec/"] and "runs past the end" in report["errors"][0][
        "reason"]
    rec.with_suffix(".idx").write_text("".join(f"{i}\t{o}\n" for i, o in enumerate(offsets)))
    report = convert_ok(rec, tmp_path / "idx.lmdb")  # with an index, only record 2 is lost
    assert [e["path"] for e in report["errors"]] == ["data.rec/2"]
    assert "runs past the record's end" in report["errors"][0]["reason"]
    assert open_dataset(tmp_path / "idx.lmdb").targets == [ITEMS[i].label for i in (0, 1, 3)]
    rec.with_suffix(".idx").write_text("0\t0\n1\t999999999\n")
    res = run_cli("convert", rec, "--to", "lmdb", "-o", tmp_path / "bad.lmdb")
    assert res.returncode == 2 and "Traceback" not in res.stderr and "data.idx: offsets" in res.stderr



def test_huge_and_negative_labels_are_record_errors_in_bounded_memory(tmp_path):
    """An IRHeader label of 1e8 once built 100 million class names, one of 3e38 an OverflowError: each is now
    its record's error (key and byte offset), the rest converts, in a child allowed 1 GiB."""
    rec = tmp_path / "data.rec"
    labels = [0.0, 1e8, 3e38, -2.0, [5e9], 1.0]
    offsets = write_mxnet_rec(rec, [(ITEMS[i].image, lab, i) for i, lab in enumerate(labels)])
    status, report = limited_convert(rec, tmp_path / "out.lmdb", order="source")
    assert status == "ok", report
    reasons = {e["path"]: (e["reason"], e["location"]) for e in report["errors"]}
    assert set(reasons) == {"data.rec/1", "data.rec/2", "data.rec/3", "data.rec/4"}
    assert reasons["data.rec/1"] == ("label 100000000 above 1,048,575: give --classes-file to name its classes",
                                     f"data.rec: record at byte {offsets[1]}")
    assert "above 1,048,575" in reasons["data.rec/2"][0] and "above 1,048,575" in reasons["data.rec/4"][0]
    assert reasons["data.rec/3"][0] == "label -2: negative, not a class index"
    ds = open_dataset(tmp_path / "out.lmdb")
    assert ds.targets == [0, 1] and ds.classes == ["0", "1"]


def test_minus_one_labels_are_flat_only_when_every_label_is(tmp_path):
    rec = tmp_path / "data.rec"
    write_mxnet_rec(rec, [(ITEMS[i].image, lab, i) for i, lab in enumerate([-1.0, 2.0, -1.0])])
    res = convert(rec, tmp_path / "o.lmdb", workers=0, progress=False)
    assert [(e.path, e.reason) for e in res.errors] == [("data.rec/0", "label -1: negative, not a class index"),
                                                        ("data.rec/2", "label -1: negative, not a class index")]
    write_mxnet_rec(rec, [(ITEMS[i].image, -1.0, i) for i in range(3)])
    ds = open_dataset(convert(rec, tmp_path / "f.lmdb", workers=0, progress=False).output)
    assert ds.targets == [-1, -1, -1] and ds.classes == []
