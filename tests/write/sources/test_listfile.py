"""List-file sources: CSV/TSV with a header and Caffe's ``path label`` lines, read where the images are."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from support.memlimit import limited_convert

from packer import PackerError, convert, open_dataset
from packer.tools.verify import verify
from packer.write.convert import convert_split
from packer.write.sources.base import SourceOptions
from packer.write.sources.registry import scan_source
from tests.support.cli import run_cli
from tests.support.imagesets import make_imagefolder


@pytest.fixture
def imgs(tmp_path) -> Path:
    return make_imagefolder(tmp_path / "imgs", classes=3, per_class=4)


def _errors(out: Path) -> list[dict]:
    return json.loads((out / "errors.json").read_text())["errors"]


def test_csv_with_class_names_converts_and_verifies(imgs, tmp_path):
    rows = ["path,label,caption"] + [f"{p.relative_to(imgs).as_posix()},{p.parent.name[-1]}x,cap {i}"
                                     for i, p in enumerate(sorted(imgs.rglob("*.jpg")))]
    listing = tmp_path / "labels.csv"
    listing.write_text("\n".join(rows) + "\n")
    res = convert(listing, tmp_path / "o.lmdb", root=imgs, workers=0, progress=False)
    ds = open_dataset(res.output)
    assert ds.classes == ["0x", "1x", "2x"]  # names sorted, as ImageFolder numbers folders
    assert [p for p, _ in ds.samples] == [str(imgs / rel) for rel in ds.relpaths]  # files below --root
    for rel, label in zip(ds.relpaths, ds.targets):
        assert ds.classes[label] == rel.split("/")[0][-1] + "x"
        assert bytes(ds.read_payload(ds.index_of(rel))) == (imgs / rel).read_bytes()
    assert ds.manifest.source_type == "list" and ds.manifest.source_options["root"] == str(imgs)
    assert verify(res.output, against=listing).ok  # the recorded --root is used
    scan = scan_source(listing, SourceOptions(root=str(imgs)))
    assert scan.fields["caption"][:2] == [b"cap 0", b"cap 1"] and scan.locs[:2] == [2, 3]


def test_caffe_list_with_integer_labels_and_a_classes_file(imgs, tmp_path):
    files = sorted(imgs.rglob("*.jpg"))
    listing = tmp_path / "train.txt"
    listing.write_text("".join(f"{p.relative_to(imgs).as_posix()} {int(p.parent.name[-1]) * 2}\n" for p in files))
    res = convert(listing, tmp_path / "o.hdf5", to="hdf5", root=imgs, workers=0, progress=False, order="source")
    ds = open_dataset(res.output)
    assert ds.classes == ["0", "1", "2", "3", "4"]  # integers keep their values: classes 0..max
    assert [t for _, t in ds.samples] == [int(p.parent.name[-1]) * 2 for p in files]  # the list's order
    names = tmp_path / "names.txt"
    names.write_text("a\nb\nc\nd\ne\n")
    res = convert(listing, tmp_path / "n.hdf5", to="hdf5", root=imgs, classes_file=names, workers=0, progress=False)
    assert open_dataset(res.output).classes == ["a", "b", "c", "d", "e"]
    assert verify(res.output, against=listing).ok


def test_bad_rows_are_errors_with_their_line_numbers(imgs, tmp_path):
    (tmp_path / "secret.jpg").write_bytes((imgs / "class_0" / "img_000.jpg").read_bytes())
    lines = ["path\tlabel", "class_0/img_000.jpg\t0", "../secret.jpg\t0", "/etc/passwd\t1",
             "class_0/img_000.jpg\t1", "class_1/img_000.jpg\tseven", "class_1/missing.jpg\t1",
             "class_2/img_000.jpg\t2\textra", "class_2/img_001.jpg\t2", "class_2/img_002.jpg\t-1"]
    listing = tmp_path / "l.tsv"
    listing.write_text("\n".join(lines) + "\n")
    res = convert(listing, tmp_path / "o.lmdb", root=imgs, workers=0, progress=False)
    assert res.num_samples == 2
    where = {e["location"]: e["reason"] for e in _errors(res.output)}
    assert set(where) == {f"l.tsv line {n}" for n in (3, 4, 5, 6, 7, 8, 10)}
    assert "leaves --root" in where["l.tsv line 3"] and "leaves --root" in where["l.tsv line 4"]
    assert "listed twice (first on line 2)" in where["l.tsv line 5"]
    assert "seven" in where["l.tsv line 6"] and "-1" in where["l.tsv line 10"]
    assert "No such file" in where["l.tsv line 7"]
    assert "3 fields" in where["l.tsv line 8"]
    assert verify(res.output, against=listing).ok


@pytest.mark.parametrize("text, flags, message", [
    ("file,label\na.jpg,0\n", [], "no column 'path' in the header (file, label); name the right one with --path-col"),
    ("path,label\n", [], "no usable rows"),
    ("a.jpg 0\n", ["--path-column", "x"], "--path-column/--label-column apply to .csv/.tsv"),
])
def test_a_wrong_list_is_one_clear_error(tmp_path, text, flags, message):
    listing = tmp_path / ("l.csv" if "," in text else "l.txt")
    listing.write_text(text)
    proc = run_cli("convert", listing, "-o", tmp_path / "o.lmdb", "-q", *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr and proc.stderr.startswith(f"packer: error: {listing}")
    assert not (tmp_path / "o.lmdb").exists()


def test_cli_converts_a_list_with_root_and_columns(imgs, tmp_path):
    listing = tmp_path / "meta" / "k.csv"
    listing.parent.mkdir()
    listing.write_text("id,file,cls\n" + "".join(f"{i},{p.relative_to(imgs).as_posix()},{p.parent.name}\n"
                                                 for i, p in enumerate(sorted(imgs.rglob("*.jpg")))))
    proc = run_cli("convert", listing, "--root", imgs, "--path-column", "file", "--label-column", "cls", "-o",
                   tmp_path / "o.lmdb", "-q", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    ds = open_dataset(tmp_path / "o.lmdb")
    assert ds.classes == ["class_0", "class_1", "class_2"] and len(ds) == 12
    assert run_cli("verify", tmp_path / "o.lmdb", "--against", listing, "-q").returncode == 0
    assert np.array_equal(np.bincount(ds.targets), [4, 4, 4])


def test_split_reports_each_error_once(imgs, tmp_path):
    rels = sorted(p.relative_to(imgs).as_posix() for p in imgs.rglob("*.jpg"))
    damaged = imgs / rels[5]
    damaged.write_bytes(damaged.read_bytes()[:40])
    rows = [f"{r} {r[6]}" for r in rels] + ["../outside.jpg 0", f"{rels[0]} 1", "nolabel.jpg"]
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(rows) + "\n")
    train, val = convert_split(listing, tmp_path / "o", split=0.5, root=imgs, workers=0, progress=False)
    scan_errors = {("../outside.jpg", "list.txt line 13"), (rels[0], "list.txt line 14"),
                   ("nolabel.jpg", "list.txt line 15")}
    reported = [(e["path"], e.get("location", "")) for part in (train, val) for e in _errors(part.output)]
    assert len(reported) == len(set(reported)) == 4  # every error once, in one of the two parts
    assert scan_errors <= {(e["path"], e.get("location", "")) for e in _errors(train.output)}
    assert (rels[5], "list.txt line 6") in reported  # the damaged image: in the part it was drawn into
    report = json.loads((val.output / "errors.json").read_text())
    assert report["ignored"]["refused by the scan: listed in the train part's errors.json"] == 3
    assert len(train.errors) + len(val.errors) == 4


def im2rec_list(root: Path, out: Path, shuffle_seed: int | None = 100) -> None:
    """``im2rec.py --list --recursive`` (MXNet tools/im2rec.py ``list_image`` + ``write_list``): a label per folder
    in walk order, lines ``index<TAB>label as %f<TAB>relative path``, shuffled by default."""
    import random

    items, cat, i = [], {}, 0
    for path, dirs, files in os.walk(root, followlinks=True):
        dirs.sort()
        files.sort()
        for fname in files:
            fpath = os.path.join(path, fname)
            if os.path.isfile(fpath) and os.path.splitext(fname)[1].lower() in (".jpeg", ".jpg", ".png"):
                cat.setdefault(path, len(cat))
                items.append((i, os.path.relpath(fpath, root), cat[path]))
                i += 1
    if shuffle_seed is not None:
        random.seed(shuffle_seed)
        random.shuffle(items)
    with open(out, "w") as fout:
        for item in items:
            fout.write(f"{item[0]:d}\t" + "".join(f"{j:f}\t" for j in item[2:]) + f"{item[1]}\n")  # im2rec's %d %f %s


def test_mxnet_lst_from_im2rec_is_recognised(imgs, tmp_path):
    listing = tmp_path / "train.lst"
    im2rec_list(imgs, listing)
    assert "\t0.000000\t" in listing.read_text()
    out = tmp_path / "o.lmdb"
    r = run_cli("convert", listing, "--root", imgs, "--to", "lmdb", "-o", out, "--workers", "0", "-q")
    assert r.returncode == 0, r.stderr
    ds = open_dataset(out)
    assert len(ds) == 12 and ds.classes == ["0", "1", "2"] and ds.manifest.source_type == "list"
    for rel, label in zip(ds.relpaths, ds.targets):
        assert label == int(rel.split("/")[0][-1])  # class_k -> k, as im2rec numbered the folders
        assert bytes(ds.read_payload(ds.index_of(rel))) == (imgs / rel).read_bytes()


def test_mxnet_lst_bad_lines_are_errors_with_their_line(imgs, tmp_path):
    listing = tmp_path / "train.lst"
    listing.write_text("0\t1.000000\tclass_1/img_000.jpg\n1\t2.500000\tclass_2/img_000.jpg\n"
                       "2\t1.000000\t0.000000\tclass_0/img_000.jpg\n3\t0.000000\tclass_0/img_001.jpg\n")
    res = convert(listing, tmp_path / "o.lmdb", root=imgs, workers=0, progress=False)
    assert open_dataset(res.output).relpaths == ["class_1/img_000.jpg", "class_0/img_001.jpg"]
    assert sorted((e["location"], e["reason"]) for e in _errors(res.output)) == [
        ("train.lst line 2", "label '2.500000': not an integer"),
        ("train.lst line 3", "2 labels: packer keeps one label per image")]
def test_extra_columns_become_typed_fields(imgs, tmp_path):
    files = sorted(imgs.rglob("*.jpg"))
    rows = ["path,label,caption,bbox x,score,1st"] + [
        f"{p.relative_to(imgs).as_posix()},{i % 3},cap {i},{i * 10},{i / 4},{'n/a' if i == 2 else i}"
        for i, p in enumerate(files)]
    listing = tmp_path / "labels.csv"
    listing.write_text("\n".join(rows) + "\n")
    res = convert(listing, tmp_path / "f.lmdb", root=imgs, workers=0, progress=False)  # stored shuffled
    ds = open_dataset(res.output)
    assert ds.field_specs == {"caption": "str", "bbox_x": "int", "score": "float", "c_1st": "str"}
    for i, p in enumerate(files):
        k = ds.index_of(p.relative_to(imgs).as_posix())
        assert (ds.field("caption", k), ds.field("bbox_x", k), ds.field("score", k)) == (f"cap {i}", i * 10, i / 4)
        assert ds.field("c_1st", k) == ("n/a" if i == 2 else str(i))
    assert verify(res.output, against=listing).ok  # the fields too, byte for byte


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".txt"])
def test_huge_negative_and_non_integer_labels_are_row_errors_in_bounded_memory(imgs, tmp_path, suffix):
    """One label of 100 million once built 100 million class names (OOM-killed); one of 20 digits gave a
    MemoryError. Each bad label is now its row's error, the rest converts, all in a child allowed 1 GiB."""
    files = [p.relative_to(imgs).as_posix() for p in sorted(imgs.rglob("*.jpg"))][:8]
    labels = ["0", "100000000", "99999999999999999999", "-3", "1.5", "7" * 5000, "\u00b2", "2"]
    sep = {".csv": ",", ".tsv": "\t", ".txt": " "}[suffix]
    head = [] if suffix == ".txt" else [f"path{sep}label"]
    listing = tmp_path / f"big{suffix}"
    listing.write_text("\n".join(head + [f"{f}{sep}{t}" for f, t in zip(files, labels)]) + "\n")
    status, report = limited_convert(listing, tmp_path / "o.lmdb", root=imgs)
    assert status == "ok", report
    first = 1 if head else 0
    where = {int(e["location"].rsplit(" ", 1)[1]) - first - 1: e["reason"] for e in report["errors"]}
    assert sorted(where) == [1, 2, 3, 4, 5, 6]
    assert where[1] == "label 100000000 above 1,048,575: give --classes-file to name its classes"
    assert "above 1,048,575: give --classes-file" in where[2] and "99999999999999999999" in where[2]
    assert "above 1,048,575" in where[5] and "(5000 characters)" in where[5]  # shown cut, never converted
    assert "negative" in where[3] and "not an integer" in where[4] and "not an integer" in where[6]
    ds = open_dataset(tmp_path / "o.lmdb")
    assert ds.classes == ["0", "1", "2"] and sorted(ds.targets) == [0, 2]


def test_a_classes_file_names_labels_above_the_bound(imgs, tmp_path):
    """With --classes-file, a label is checked against its classes, whatever their number."""
    files = [p.relative_to(imgs).as_posix() for p in sorted(imgs.rglob("*.jpg"))][:3]
    names = tmp_path / "names.txt"
    names.write_text("".join(f"c{i}\n" for i in range((1 << 20) + 2)))
    listing = tmp_path / "l.csv"
    listing.write_text(f"path,label\n{files[0]},{1 << 20}\n{files[1]},{(1 << 20) + 2}\n{files[2]},0\n")
    res = convert(listing, tmp_path / "o.lmdb", root=imgs, classes_file=names, workers=0, progress=False)
    assert [e.reason for e in res.errors] == [f"label {(1 << 20) + 2} is not one of the {(1 << 20) + 2} classes "
                                              f"(0..{(1 << 20) + 1})"]
    assert sorted(open_dataset(res.output).targets) == [0, 1 << 20]


def test_class_names_that_are_no_folder_name_are_row_errors_or_refused(imgs, tmp_path):
    """``packer extract`` makes a folder per class: a list naming a class ``../evil`` or ``/abs`` has those rows
    refused (their line in errors.json); a --classes-file holding one is refused whole, naming the line."""
    files = [p.relative_to(imgs).as_posix() for p in sorted(imgs.rglob("*.jpg"))][:5]
    listing = tmp_path / "l.csv"
    listing.write_text("path,label\n" + "".join(f"{f},{c}\n" for f, c in zip(files, ["cat", "../evil", "/abs",
                                                                                      "..", "dog"])))
    res = convert(listing, tmp_path / "o.lmdb", root=imgs, workers=0, progress=False)
    assert open_dataset(res.output).classes == ["cat", "dog"]
    why = {e.location: e.reason for e in res.errors}
    assert set(why) == {"l.csv line 3", "l.csv line 4", "l.csv line 5"}
    assert why["l.csv line 3"].startswith("class name '../evil' holds a path separator")
    names = tmp_path / "names.txt"
    names.write_text("cat\nbad\x00name\n")
    with pytest.raises(PackerError, match=r"names.txt line 2: class name 'bad\\x00name' holds a NUL byte"):
        convert(listing, tmp_path / "n.lmdb", root=imgs, classes_file=names, workers=0, progress=False)
    assert not (tmp_path / "n.lmdb").exists()
