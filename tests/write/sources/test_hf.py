"""Hugging Face datasets as a source: made by ``datasets`` in the test (save_to_disk, Parquet),
read by packer through pyarrow alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import REPO, run_cli
from support.foreign import items, make_hf
from support.memlimit import limited_convert

from packer import open_dataset

ITEMS = items(10)
NAMES = ["cat", "dog", "emu"]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> tuple[Path, Path]:
    return make_hf(tmp_path_factory.mktemp("hf"), ITEMS, NAMES, rows_per_group=4)


def convert_ok(src: Path, out: Path, *args: object) -> dict:
    res = run_cli("convert", src, "--to", "lmdb", "-o", out, "--workers", "2", "--order", "source", *args)
    report = json.loads((out / "errors.json").read_text())
    assert res.returncode == (1 if report["num_errors"] else 0), res.stderr  # 1: some records not packed
    return report


@pytest.mark.parametrize("layout", ["save_to_disk", "parquet"])
def test_rows_convert_with_their_bytes_classlabel_names_and_verify(hf, tmp_path, layout):
    src = hf[0] if layout == "save_to_disk" else hf[1]
    out = tmp_path / "out.lmdb"
    assert convert_ok(src, out)["num_errors"] == 0
    ds = open_dataset(out)
    assert [bytes(ds.read_payload(i)) for i in range(len(ds))] == [it.image for it in ITEMS]
    assert ds.targets == [it.label for it in ITEMS] and ds.classes == NAMES
    name = "data-00000-of-00001.arrow" if layout == "save_to_disk" else "data.parquet"
    assert list(ds.index.rel_paths()) == [f"{name}/{i}.jpg" for i in range(len(ITEMS))]
    res = run_cli("verify", out, "--against", src)
    assert res.returncode == 0, res.stdout + res.stderr


def test_packer_reads_them_without_importing_datasets(hf, tmp_path):
    code = ("import sys; from packer import convert; "
            f"convert({str(hf[1])!r}, {str(tmp_path / 'o.lmdb')!r}, workers=0, progress=False); "
            "print('datasets' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0 and res.stdout.strip() == "False", res.stderr


def test_path_only_rows_are_errors_without_root_and_read_from_root_with_it(tmp_path):
    import datasets

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for it in ITEMS[:3]:
        (imgs / f"{it.key}.jpg").write_bytes(it.image)
    table = datasets.Dataset.from_dict(
        {"image": [{"bytes": None, "path": f"{it.key}.jpg"} for it in ITEMS[:3]] + [{"bytes": ITEMS[3].image,
                                                                                    "path": None}],
         "label": [0, 1, 2, 1]},
        features=datasets.Features({"image": datasets.Image(decode=False), "label": datasets.ClassLabel(names=NAMES)}))
    import pyarrow.parquet as pq  # datasets' to_parquet would embed the files: write the table it holds as it is

    pq.write_table(table.data.table, tmp_path / "p.parquet")
    report = convert_ok(tmp_path / "p.parquet", tmp_path / "a.lmdb")
    assert report["num_errors"] == 3 and all("give --root" in e["reason"] for e in report["errors"])
    assert {e["location"] for e in report["errors"]} == {f"p.parquet: row {r}" for r in range(3)}
    assert open_dataset(tmp_path / "a.lmdb").targets == [1]
    assert convert_ok(tmp_path / "p.parquet", tmp_path / "b.lmdb", "--root", imgs)["num_errors"] == 0
    ds = open_dataset(tmp_path / "b.lmdb")
    assert [bytes(ds.read_payload(i)) for i in range(4)] == [it.image for it in ITEMS[:4]]


def test_a_wrong_column_name_is_one_clear_line(hf, tmp_path):
    res = run_cli("convert", hf[1], "--to", "lmdb", "-o", tmp_path / "o.lmdb", "--image-column", "picture")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "no column 'picture' (columns: image, label)" in res.stderr and res.stderr.count("\n") == 1


def test_an_unreadable_parquet_file_is_one_clear_line(hf, tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(hf[1].read_bytes()[:-200])
    res = run_cli("convert", bad, "--to", "lmdb", "-o", tmp_path / "o.lmdb")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{bad}: not a readable parquet file" in res.stderr and res.stderr.count("\n") == 1


def test_without_pyarrow_the_error_names_the_extra(hf, tmp_path):
    code = ("import sys; sys.modules['pyarrow'] = None; from packer import convert; "
            f"convert({str(hf[1])!r}, {str(tmp_path / 'o.lmdb')!r}, workers=0, progress=False)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "MissingPackageError" in res.stderr and "pip install -e '.[hf]'" in res.stderr, res.stderr


@pytest.mark.parametrize("layout", ["save_to_disk", "parquet"])
def test_other_scalar_columns_become_fields(tmp_path, layout):
    import datasets

    rows = ITEMS[:6]
    ds = datasets.Dataset.from_dict({
        "image": [{"bytes": it.image, "path": f"{it.key}.jpg"} for it in rows], "label": [it.label for it in rows],
        "caption": [f"photo {i}" for i in range(6)], "score": [i / 8 for i in range(6)],
        "count": [i * 7 for i in range(6)], "maybe": [None if i == 3 else i for i in range(6)],
        "flag": [i % 2 == 0 for i in range(6)], "tags": [["a"] * i for i in range(6)],  # a list: not a scalar
    }, features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES),
                                   "caption": datasets.Value("string"), "score": datasets.Value("float32"),
                                   "count": datasets.Value("int64"), "maybe": datasets.Value("int32"),
                                   "flag": datasets.Value("bool"),
                                   "tags": datasets.Sequence(datasets.Value("string"))}))
    src = tmp_path / "saved" if layout == "save_to_disk" else tmp_path / "d.parquet"
    if layout == "save_to_disk":
        ds.save_to_disk(str(src))
    else:
        ds.to_parquet(str(src), batch_size=4)
    out = tmp_path / "o.lmdb"
    assert convert_ok(src, out)["num_errors"] == 0
    got = open_dataset(out)
    assert got.field_specs == {"caption": "str", "score": "float", "count": "int", "maybe": "json", "flag": "json"}
    for i in range(6):
        assert (got.field("caption", i), got.field("score", i), got.field("count", i)) == (f"photo {i}", i / 8, i * 7)
        assert got.field("maybe", i) == (None if i == 3 else i) and got.field("flag", i) is (i % 2 == 0)


def _label_table(path: Path, labels: list[int], label_type: str) -> None:
    """A Parquet file of Image structs and an integer label column (no ClassLabel: classes are 0..max)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.array([{"bytes": ITEMS[i].image, "path": f"{ITEMS[i].key}.jpg"} for i in range(len(labels))],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"image": image, "label": pa.array(labels, getattr(pa, label_type)())}), path)


@pytest.mark.parametrize("label_type", ["int64", "uint64"])
def test_huge_and_negative_labels_are_row_errors_in_bounded_memory(tmp_path, label_type):
    """A label column holding 100000000 once built 100 million class names, 2**64-1 an OverflowError: each is
    now its row's error (file and row), the rest converts, in a child allowed 1 GiB."""
    big = 2**64 - 1 if label_type == "uint64" else 2**63 - 1
    labels = [0, 100_000_000, big, 1] + ([-4] if label_type == "int64" else [])
    _label_table(tmp_path / "p.parquet", labels, label_type)
    status, report = limited_convert(tmp_path / "p.parquet", tmp_path / "o.lmdb")
    assert status == "ok", report
    reasons = {e["location"]: e["reason"] for e in report["errors"]}
    assert reasons["p.parquet: row 1"] == "label 100000000 above 1,048,575: give --classes-file to name its classes"
    assert reasons["p.parquet: row 2"] == f"label {big} above 1,048,575: give --classes-file to name its classes"
    assert len(reasons) == len(labels) - 2
    if label_type == "int64":
        assert reasons["p.parquet: row 4"] == "label -4: negative, not a class index"
    ds = open_dataset(tmp_path / "o.lmdb")
    assert ds.targets == [0, 1] and ds.classes == ["0", "1"]


def test_class_label_names_that_are_no_folder_name_are_refused_naming_the_class(tmp_path):
    """``packer extract`` makes a folder per class: a ClassLabel naming ``../evil`` is refused before anything
    is written, naming the class; a label past the ClassLabel's names is its row's error."""
    import datasets

    for names, refused in ((["cat", "../evil"], "class 1: class name '../evil'"),
                           (["cat", "/abs"], "class 1: class name '/abs'"), (["cat", "ok"], None)):
        ds = datasets.Dataset.from_dict({"image": [{"bytes": it.image, "path": None} for it in ITEMS[:3]],
                                         "label": [0, 1, 0]},
                                        features=datasets.Features({"image": datasets.Image(),
                                                                    "label": datasets.ClassLabel(names=names)}))
        src, out = tmp_path / f"{len(names)}{refused is None}.parquet", tmp_path / f"{names[1][-3:]}.lmdb"
        ds.to_parquet(str(src))
        res = run_cli("convert", src, "--to", "lmdb", "-o", out, "--workers", "0")
        if refused is None:
            assert res.returncode == 0 and open_dataset(out).classes == names
            continue
        assert res.returncode == 2 and "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
        assert refused in res.stderr and "one plain folder name" in res.stderr and not out.exists()
