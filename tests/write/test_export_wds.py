"""WebDataset export (``packer convert SRC --to wds``), read back through the ``webdataset`` package itself."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset
from PIL import Image

from packer import convert, export_wds, open_dataset
from packer.errors import PackerError
from packer.layout.manifest import sha256_file
from packer.layout.wdsexport import EXPORT_NAME
from packer.write.journal import write_plan, write_swap
from tests.support.cli import REPO, run_cli
from tests.support.imagefolder import ImageFolder
from tests.support.imagesets import jpeg_bytes, make_flat, make_imagefolder


def read_wds(out: Path) -> dict[int, dict]:
    """Every sample of the export as the webdataset package gives it, by key number (keys must be unique)."""
    shards = sorted(str(p) for p in out.glob("shard-*.tar"))
    found: dict[int, dict] = {}
    for sample in webdataset.WebDataset(shards, shardshuffle=False):
        key = int(sample["__key__"])
        assert key not in found
        found[key] = sample
    return found


@pytest.fixture
def dotted(tmp_path) -> Path:
    """An ImageFolder with dots in class and file names (webdataset ends a key at a base name's first dot)."""
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=4)
    (src / "a.b").mkdir()
    (src / "a.b" / "c.d.jpg").write_bytes(jpeg_bytes(np.random.default_rng(5), 20, 30))
    (src / "a.b" / "e.f.g.JPG").write_bytes(jpeg_bytes(np.random.default_rng(6), 22, 26))
    return src


@pytest.mark.parametrize("order", ["shuffled", "source"])
def test_folder_export_reads_back_through_webdataset(dotted, tmp_path, order):
    res = export_wds(dotted, tmp_path / "out", order=order, workers=0, progress=False)
    reference = ImageFolder(dotted)
    got = read_wds(res.output)
    assert sorted(got) == list(range(len(reference))) and res.num_samples == len(reference)
    for i, (path, label) in enumerate(reference.samples):
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        assert got[i][ext] == Path(path).read_bytes()  # the stored bytes, unchanged
        assert int(got[i]["cls"]) == label
    assert (res.output / "classes.txt").read_text().splitlines() == reference.classes
    stored = [int(s["__key__"]) for s in webdataset.WebDataset(sorted(str(p) for p in res.output.glob("*.tar")),
                                                                shardshuffle=False)]
    assert (stored == sorted(stored)) == (order == "source")


def test_packed_dataset_export_keys_are_dataset_indices(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=3, per_class=5)
    ds = open_dataset(convert(src, tmp_path / "d.lmdb", workers=0, progress=False).output)  # shuffled storage
    got = read_wds(export_wds(ds.root, tmp_path / "out", workers=0, progress=False).output)
    assert len(got) == len(ds)
    for i in range(len(ds)):
        assert got[i]["jpg"] == bytes(ds.read_payload(i)) and int(got[i]["cls"]) == ds.targets[i]


def test_raw_payload_dataset_round_trips_pixels_as_png(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=3)
    ds = open_dataset(convert(src, tmp_path / "raw.lmdb", payload="raw", workers=0, progress=False).output)
    got = read_wds(export_wds(ds.root, tmp_path / "out", workers=0, progress=False).output)
    for i in range(len(ds)):
        assert set(got[i]) >= {"png", "cls"} and "jpg" not in got[i]
        pixels = np.asarray(Image.open(io.BytesIO(got[i]["png"])))
        np.testing.assert_array_equal(pixels, np.asarray(ds[i][0]))


def test_shard_size_bounds_every_tar_and_the_index_lists_them(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=20, size=(48, 64))
    limit = 40 << 10
    out = export_wds(src, tmp_path / "out", shard_bytes=limit, workers=0, progress=False).output
    index = json.loads((out / EXPORT_NAME).read_text())
    assert len(index["shards"]) > 2 and sum(s["num_samples"] for s in index["shards"]) == index["num_samples"] == 40
    for shard in index["shards"]:
        path = out / shard["name"]
        assert path.stat().st_size == shard["num_bytes"] <= limit
        assert sha256_file(path) == shard["sha256"]
        with tarfile.open(path) as tar:
            assert len({m.name.split(".")[0] for m in tar.getmembers()}) == shard["num_samples"]


@pytest.mark.parametrize("given", ["folder", "pattern", "one shard"])
def test_export_converts_back_to_identical_indices_paths_payloads_and_labels(dotted, tmp_path, given):
    """The README's round trip: the folder, a brace pattern or a single shard of an export converts back with the
    source's indices, relative paths, bytes, labels and class names (classes.txt beside the shards)."""
    out = export_wds(dotted, tmp_path / "out", workers=0, progress=False, shard_bytes=None if given == "folder"
                     else 64 << 20).output  # the pattern and the shard name all samples: one shard
    src = {"folder": out, "pattern": out / "shard-{000000..000000}.tar", "one shard": out / "shard-000000.tar"}[given]
    extra = ["--source-type", "webdataset"] if given == "one shard" else []  # a lone .tar is an archive otherwise
    r = run_cli("convert", src, *extra, "--to", "hdf5", "-o", tmp_path / "back.hdf5", "--workers", "0", "-q")
    assert r.returncode == 0, r.stderr
    back = open_dataset(tmp_path / "back.hdf5")
    reference = ImageFolder(dotted)
    assert back.classes == reference.classes and back.manifest.source_type == "webdataset"
    assert len(back) == len(reference) and back.indexing == "imagefolder"
    assert back.relpaths == [os.path.relpath(p, dotted) for p, _ in reference.samples]
    for i, (path, label) in enumerate(reference.samples):
        assert bytes(back.read_payload(i)) == Path(path).read_bytes() and back.targets[i] == label
    assert "ds[i] is source record i" in run_cli("info", tmp_path / "back.hdf5").stdout


def test_every_image_kind_the_export_writes_converts_back(tmp_path):
    """bmp, tif, ppm, gif members (not webdataset's jpg/png/webp) come back too from packer's own export."""
    src = tmp_path / "kinds"
    (src / "a").mkdir(parents=True)
    img = Image.fromarray(np.random.default_rng(1).integers(0, 255, (12, 10, 3), dtype=np.uint8))
    for ext, fmt in (("bmp", "BMP"), ("tif", "TIFF"), ("ppm", "PPM"), ("png", "PNG")):
        img.save(src / "a" / f"x.{ext}", format=fmt)
    out = export_wds(src, tmp_path / "out", workers=0, progress=False).output
    back = open_dataset(convert(out, tmp_path / "back.lmdb", workers=0, progress=False).output)
    assert back.relpaths == ["a/x.bmp", "a/x.png", "a/x.ppm", "a/x.tif"]
    assert all(bytes(back.read_payload(i)) == (src / r).read_bytes() for i, r in enumerate(back.relpaths))


def test_unreadable_records_go_to_errors_json_and_leave_their_number_unused(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=3)
    bad = src / "class_1" / "img_001.jpg"
    bad.write_bytes(bad.read_bytes()[:50])
    res = export_wds(src, tmp_path / "out", workers=0, progress=False)
    reference = [p for p, _ in ImageFolder(src).samples]
    assert sorted(read_wds(res.output)) == [i for i in range(6) if reference[i] != str(bad)]
    report = json.loads((res.output / "errors.json").read_text())
    assert [e["path"] for e in report["errors"]] == ["class_1/img_001.jpg"] and report["num_errors"] == 1


def test_list_file_columns_become_the_json_member(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2)
    rels = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.jpg"))
    listing = tmp_path / "labels.csv"
    listing.write_text("path,label,caption\n" + "".join(f"{r},{r[6]},cap {k}\n" for k, r in enumerate(rels)))
    got = read_wds(export_wds(listing, tmp_path / "out", root=src, workers=0, progress=False).output)
    assert [json.loads(got[k]["json"]) for k in range(len(rels))] == [{"caption": f"cap {k}"} for k in range(len(rels))]


def test_an_error_midway_leaves_nothing_that_looks_complete(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=6)
    (src / "class_1" / "img_005.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(PackerError, match="img_005"):
        export_wds(src, tmp_path / "out", on_error="raise", order="source", shard_bytes=1, workers=0, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_killed_export_never_looks_complete(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=4, per_class=100)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "packer", "convert", str(src), "--to", "wds", "-o", str(out),
                             "--shard-size", "16KB", "--workers", "0", "-q"], env=env)
    deadline = time.monotonic() + 60
    while not (out.with_name("out.partial") / "shard-000002.tar").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, "the export finished before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = tmp_path / "out.partial"
    assert not out.exists() and partial.is_dir() and not (partial / EXPORT_NAME).exists()
    r = run_cli("convert", src, "--to", "wds", "-o", out, "-q")
    assert r.returncode == 2 and "out.partial" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_overwrite_replaces_only_an_export(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2)
    out = export_wds(src, tmp_path / "out", workers=0, progress=False).output
    with pytest.raises(PackerError, match="already exists"):
        export_wds(src, out, workers=0, progress=False)
    assert export_wds(src, out, overwrite=True, workers=0, progress=False).num_samples == 4
    (tmp_path / "other").mkdir()
    with pytest.raises(PackerError, match="not a packer dataset"):
        export_wds(src, tmp_path / "other", overwrite=True, workers=0, progress=False)


def test_options_that_would_change_bytes_are_refused_in_one_line(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2)
    r = run_cli("convert", src, "--to", "wds", "--payload", "raw")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "packer: error: --payload: not an option of --to wds (it stores the source's encoded bytes as they are; "
        "decoded pixels as lossless PNG)"]


def test_resume_finishes_a_journaled_move_into_place(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2)
    out = export_wds(src, tmp_path / "out", workers=0, progress=False).output
    partial = tmp_path / "out.partial"
    out.rename(partial)  # what a kill between the journaled swap and the rename leaves
    write_plan(partial, {"kind": "packer-webdataset-export"})
    write_swap(partial, None)
    with pytest.raises(PackerError, match="resume=True"):
        export_wds(src, out, workers=0, progress=False)
    assert export_wds(src, out, resume=True, workers=0, progress=False).num_samples == 4
    assert not partial.exists() and not (out / "journal").exists() and len(read_wds(out)) == 4


@pytest.mark.parametrize("kind", ["tar", "zip", "tar.gz"])
def test_archive_sources_export_in_imagefolder_order(dotted, tmp_path, kind):
    import zipfile

    archive = tmp_path / f"train.{kind}"
    if kind == "zip":
        with zipfile.ZipFile(archive, "w") as z:
            for p in sorted(dotted.rglob("*")):
                z.write(p, p.relative_to(dotted).as_posix())
    else:
        with tarfile.open(archive, "w:gz" if kind == "tar.gz" else "w") as t:
            for p in sorted(dotted.iterdir()):
                t.add(p, p.name)
    if kind == "tar.gz":  # streamed: only in stored order
        with pytest.raises(PackerError, match="order='source'"):
            export_wds(archive, tmp_path / "out", workers=0, progress=False)
    res = export_wds(archive, tmp_path / "out", order="source", workers=2, progress=False)
    reference = ImageFolder(dotted)
    got = read_wds(res.output)
    assert len(got) == len(reference)
    for i, (path, label) in enumerate(reference.samples):
        ext = os.path.splitext(path)[1].lower().lstrip(".")
        assert got[i][ext] == Path(path).read_bytes() and int(got[i]["cls"]) == label


def test_a_source_without_labels_has_no_cls_and_no_classes(tmp_path):
    src = make_flat(tmp_path / "flat", count=5)
    res = export_wds(src, tmp_path / "out", workers=0, progress=False)
    got = read_wds(res.output)
    assert len(got) == 5 and all("cls" not in s and "jpg" in s for s in got.values())
    assert not (res.output / "classes.txt").exists()
    r = run_cli("convert", res.output, "--to", "lmdb", "-o", tmp_path / "back.lmdb", "--workers", "0", "-q")
    assert r.returncode == 0, r.stderr
    back = open_dataset(tmp_path / "back.lmdb")
    assert back.classes == [] and set(back.targets) == {-1}


def test_writer_fields_become_the_json_member_in_extracts_form(tmp_path):
    """Every field kind of a Writer dataset: ``<key>.json`` holds what ``packer extract``'s sidecar holds."""
    from support.fielded import SPECS, write_fielded

    from packer.layout.fields import json_value

    samples = write_fielded(tmp_path / "f.lmdb")
    got = read_wds(export_wds(tmp_path / "f.lmdb", tmp_path / "out", workers=0, progress=False).output)
    assert sorted(got) == list(range(len(samples)))
    for i, want in enumerate(samples):
        assert got[i]["jpg"] == want["image"] and int(got[i]["cls"]) == want["label"]
        assert json.loads(got[i]["json"]) == {k: json.loads(json.dumps(json_value(want[k]))) for k in SPECS}


@pytest.mark.parametrize("count", [5, 40])
def test_default_shards_feed_webdataset_with_two_dataloader_workers(tmp_path, count, capsys):
    """The default export of a small dataset has a shard per worker and more: webdataset's own loader with
    DataLoader(num_workers=2) reads every sample once (one 256 MB shard made its second worker fail)."""
    from torch.utils.data import DataLoader

    src = make_imagefolder(tmp_path / "imgs", classes=1, per_class=count)
    out = export_wds(src, tmp_path / "out", workers=0, progress=False).output
    shards = sorted(str(p) for p in out.glob("shard-*.tar"))
    assert len(shards) == min(count, -(-count // max(1, count // 16))) and len(shards) >= min(count, 16)
    assert "fewer shards than workers" not in capsys.readouterr().err
    loader = DataLoader(webdataset.WebDataset(shards, shardshuffle=False), batch_size=None, num_workers=2)
    assert sorted(int(sample["__key__"]) for sample in loader) == list(range(count))


def test_a_shard_size_giving_few_shards_says_how_to_get_more(tmp_path, caplog):
    src = make_imagefolder(tmp_path / "imgs", classes=1, per_class=20)
    with caplog.at_level("WARNING", logger="packer"):
        out = export_wds(src, tmp_path / "out", shard_bytes=64 << 20, workers=0, progress=False).output
    assert len(list(out.glob("shard-*.tar"))) == 1
    assert "1 shard(s)" in caplog.text and "fewer shards than workers" in caplog.text
    assert "a shard size of" in caplog.text and "gives 16" in caplog.text


def test_an_export_made_before_paths_were_kept_still_converts_back(dotted, tmp_path):
    """An older export (no <key>.path.txt, no source_records): keys still number the records, paths are the
    shard's member names as before."""
    out = export_wds(dotted, tmp_path / "out", workers=0, progress=False, shard_bytes=64 << 20).output
    shard = out / "shard-000000.tar"
    with tarfile.open(shard) as tf:
        kept = [(m, tf.extractfile(m).read()) for m in tf.getmembers() if not m.name.endswith(".path.txt")]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tf:
        for m, data in kept:
            tf.addfile(m, io.BytesIO(data))
    index = json.loads((out / EXPORT_NAME).read_text())
    index.pop("source_records")
    index["shards"][0].update(num_bytes=shard.stat().st_size, sha256=sha256_file(shard))
    (out / EXPORT_NAME).write_text(json.dumps(index))
    back = open_dataset(convert(out, tmp_path / "back.lmdb", workers=0, progress=False).output)
    reference = ImageFolder(dotted)
    assert len(back) == len(reference) and back.classes == reference.classes
    assert [int(r.split("/")[1].split(".")[0]) for r in back.relpaths] == list(range(len(reference)))
    assert all(bytes(back.read_payload(i)) == Path(p).read_bytes() for i, (p, _) in enumerate(reference.samples))


def test_to_wds_is_the_export_behind_the_one_driver(dotted, tmp_path):
    """``convert(to="wds")`` is the export (the same tars, byte for byte); its index records the export's own
    options (it recorded ``format: lmdb``, the options of the driver it borrowed)."""
    a = convert(dotted, tmp_path / "a", to="wds", workers=0, progress=False, shard_bytes=16 << 10).output
    b = export_wds(dotted, tmp_path / "b", workers=2, progress=False, shard_bytes=16 << 10).output
    tars = sorted(p.name for p in a.glob("*.tar"))
    assert len(tars) > 1 and tars == sorted(p.name for p in b.glob("*.tar"))
    assert all(sha256_file(a / t) == sha256_file(b / t) for t in tars)
    options = json.loads((a / EXPORT_NAME).read_text())["options"]
    assert options["format"] == "wds" and options["payload"] == "encoded" and options["shard_bytes"] == 16 << 10


def test_a_split_export_writes_two_exports_that_add_up(tmp_path):
    """``--split`` works for every output, the export too: per class a seeded fraction in OUT-train, the rest in
    OUT-val, keyed by the source's numbers, each converting back."""
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=5)
    r = run_cli("convert", src, "--to", "wds", "--split", "0.6", "-o", tmp_path / "w", "--workers", "0", "-q")
    assert r.returncode == 0, r.stderr
    train, val = read_wds(tmp_path / "w-train"), read_wds(tmp_path / "w-val")
    assert len(train) == 6 and len(val) == 4 and sorted([*train, *val]) == list(range(10))
    reference = ImageFolder(src)
    for got in (train, val):
        for i, sample in got.items():
            assert sample["jpg"] == Path(reference.samples[i][0]).read_bytes()
            assert int(sample["cls"]) == reference.samples[i][1]


def test_an_option_the_export_used_to_drop_is_refused(tmp_path):
    """``--resize-mode fit`` with ``--to wds`` was dropped silently by the command line; it changes pixels, which an
    export never does: refused in one line, as ``--payload`` is."""
    src = make_imagefolder(tmp_path / "imgs", classes=1, per_class=2)
    r = run_cli("convert", src, "--to", "wds", "--resize-mode", "fit", "-o", tmp_path / "w")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "packer: error: --resize-mode: not an option of --to wds (it stores the source's encoded bytes as they are; "
        "decoded pixels as lossless PNG)"]
    assert not (tmp_path / "w").exists()


def test_a_move_into_place_finished_by_resume_reports_the_records_left_out(tmp_path):
    """An export whose move into place was killed, finished by ``resume``: the result lists what errors.json lists
    (it said nothing was left out)."""
    src = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2)
    (src / "class_0" / "img_001.jpg").write_bytes(b"not a jpeg")
    out = export_wds(src, tmp_path / "out", workers=0, progress=False).output
    partial = tmp_path / "out.partial"
    out.rename(partial)  # what a kill between the journaled swap and the rename leaves
    write_plan(partial, {"kind": "packer-webdataset-export"})
    write_swap(partial, None)
    res = export_wds(src, out, resume=True, workers=0, progress=False)
    assert res.num_samples == 3 and [e.path for e in res.errors] == ["class_0/img_001.jpg"]
    assert res.errors[0].index == 1 and len(read_wds(out)) == 3
