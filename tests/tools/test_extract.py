"""``packer extract`` and ``packer sample`` destinations: every target checked before anything is
written (exit 2), a failure part-way a one-line error (exit 1), names of any legal length, raw
datasets whose source had one name with two extensions."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.fuzzing import craft_rel_path
from support.imagesets import jpeg_bytes
from support.mounts import read_only_mount, small_tmpfs

from packer import PackerError, convert, open_dataset
from packer.cli import main
from packer.errors import RunError
from packer.tools.extract import extract, target_names


@pytest.fixture(scope="module")
def packed(imagefolder, tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    return {payload: convert(imagefolder, root / f"{payload}.lmdb", payload=payload, workers=0,
                             progress=False).output for payload in ("encoded", "raw")}


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("packer: error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ------------------------------------------------------------------ read-only and full destinations


def test_read_only_destination_is_refused_up_front(packed, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with read_only_mount(empty, tmp_path / "ro") as ro:
        assert main(["extract", str(packed["encoded"]), str(ro), "-q"]) == 2
        one_line_error(capsys, str(ro), "read-only file system")
        assert main(["extract", str(packed["encoded"]), str(ro / "a" / "b"), "-q"]) == 2
        one_line_error(capsys, str(ro / "a" / "b"), "read-only file system")
        assert main(["sample", str(ro / "s"), "--count", "2", "-q"]) == 2
        one_line_error(capsys, str(ro / "s"), "read-only file system")
        assert not list(ro.iterdir())


def test_full_destination_fails_part_way_with_exit_1(packed, tmp_path, capsys):
    with small_tmpfs(tmp_path / "small", "40k") as small:
        assert main(["extract", str(packed["raw"]), str(small / "x"), "-q"]) == 1
        one_line_error(capsys, str(small / "x"), "No space left on device")
        assert not list(small.rglob(".packer-*.tmp"))  # no temporary file left behind
        assert main(["sample", str(small / "s"), "--count", "20", "--classes", "2", "-q"]) == 1
        one_line_error(capsys, str(small / "s"), "No space left on device")


def test_a_file_where_the_destination_should_be(packed, tmp_path, capsys):
    (tmp_path / "f").write_bytes(b"mine")
    assert main(["extract", str(packed["encoded"]), str(tmp_path / "f" / "out"), "-q"]) == 2
    one_line_error(capsys, "is not a folder")
    assert main(["sample", str(tmp_path / "f"), "--count", "2", "-q"]) == 2
    one_line_error(capsys, "is not a folder")
    assert (tmp_path / "f").read_bytes() == b"mine"


# ------------------------------------------------------------------ names


def test_255_byte_names_extract(tmp_path):
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    long = "x" * 251 + ".jpg"  # NAME_MAX: the longest name a source may have
    (src / "c" / long).write_bytes(jpeg_bytes(np.random.default_rng(0), 20, 30))
    (src / "c" / "short.jpg").write_bytes(jpeg_bytes(np.random.default_rng(1), 20, 30))
    ds = convert(src, tmp_path / "ds.lmdb", workers=0, progress=False).output
    extract(ds, tmp_path / "out")
    assert (tmp_path / "out" / "c" / long).read_bytes() == (src / "c" / long).read_bytes()
    assert sorted(p.name for p in (tmp_path / "out" / "c").iterdir()) == sorted([long, "short.jpg"])


def png_pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def test_raw_dataset_whose_source_had_one_name_with_two_extensions(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    rng = np.random.default_rng(3)
    (src / "c" / "a.jpg").write_bytes(jpeg_bytes(rng, 20, 30))
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (12, 14, 3), dtype=np.uint8)).save(buf, format="PNG")
    (src / "c" / "a.png").write_bytes(buf.getvalue())
    (src / "c" / "b.jpg").write_bytes(jpeg_bytes(rng, 20, 30))
    ds_path = convert(src, tmp_path / "raw.lmdb", payload="raw", workers=0, progress=False).output
    out = tmp_path / "out"
    assert main(["extract", str(ds_path), str(out), "-q"]) == 0
    assert "1 of them kept their original name plus .png" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "c").iterdir()) == ["a.jpg.png", "a.png", "b.png"]
    ds = open_dataset(ds_path, image="numpy")
    for rel, name in (("c/a.jpg", "c/a.jpg.png"), ("c/a.png", "c/a.png"), ("c/b.jpg", "c/b.png")):
        assert np.array_equal(png_pixels(out / name), ds[ds.index_of(rel)][0])


def test_target_names():
    assert target_names(["c/a.jpg", "c/b.jpg"], raw=False) == ["c/a.jpg", "c/b.jpg"]
    assert target_names(["c/a.jpg", "c/b.JPEG", "d/a.bmp"], raw=True) == ["c/a.png", "c/b.png", "d/a.png"]
    assert target_names(["c/a.jpg", "c/a.png", "c/a.bmp"], raw=True) == ["c/a.jpg.png", "c/a.png", "c/a.bmp.png"]


def test_names_too_long_for_the_destination_are_refused_before_writing(tmp_path):
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    rng = np.random.default_rng(4)
    stem = "y" * 250
    (src / "c" / "a.jpg").write_bytes(jpeg_bytes(rng, 20, 30))
    (src / "c" / f"{stem}.jpg").write_bytes(jpeg_bytes(rng, 20, 30))
    (src / "c" / f"{stem}.jpeg").write_bytes(jpeg_bytes(rng, 20, 30))  # both -> yyy.png: yyy.jpeg.png, 259 bytes
    ds = convert(src, tmp_path / "raw.lmdb", payload="raw", workers=0, progress=False).output
    with pytest.raises(PackerError, match="is 259 bytes, longer than the 255 this filesystem allows"):
        extract(ds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_name_both_file_and_folder_is_refused_before_writing(packed, tmp_path):
    ds = tmp_path / "ds"
    subprocess.run(["cp", "-r", str(packed["encoded"]), str(ds)], check=True)
    first = open_dataset(ds).index.rel_path(0)
    craft_rel_path(ds, 1, first + "/inner.jpg")  # sample 0 is a file, sample 1 needs it as a folder
    with pytest.raises(PackerError, match="both a file and a folder"):
        extract(ds, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["../evil", "/abs", "a/b", ".."])
def test_a_crafted_class_name_is_refused_naming_the_class(packed, tmp_path, capsys, name):
    """Conversion refuses such names; a dataset edited to hold one (the manifest has no checksum) is refused by
    extract before anything is written, naming the class, not as some sample's path."""
    ds = tmp_path / "ds"
    subprocess.run(["cp", "-r", str(packed["encoded"]), str(ds)], check=True)
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["classes"][1] = name
    (ds / "manifest.json").write_text(json.dumps(manifest))
    assert main(["extract", str(ds), str(tmp_path / "out"), "-q"]) == 2
    one_line_error(capsys, f"class 1: class name {name!r}", "one plain folder name")
    assert not (tmp_path / "out").exists() and not (tmp_path / "evil").exists()


def test_a_folder_in_the_way_is_refused_before_writing_even_with_overwrite(packed, tmp_path):
    out = tmp_path / "out"
    rel = open_dataset(packed["encoded"]).index.rel_path(3)
    (out / rel).mkdir(parents=True)
    with pytest.raises(PackerError, match="a folder is in the way"):
        extract(packed["encoded"], out, overwrite=True)
    assert not files_under(out)


def test_damaged_dataset_exits_1_and_a_missing_one_2(packed, tmp_path, capsys):
    ds = tmp_path / "ds"
    subprocess.run(["cp", "-r", str(packed["encoded"]), str(ds)], check=True)
    (ds / "manifest.json").write_text("{ not json")
    assert main(["extract", str(ds), str(tmp_path / "out"), "-q"]) == 1
    one_line_error(capsys, "manifest.json")
    with pytest.raises(RunError):
        extract(ds, tmp_path / "out")
    assert main(["extract", str(tmp_path / "nope"), str(tmp_path / "out"), "-q"]) == 2
    one_line_error(capsys, "no such dataset")


@pytest.mark.parametrize("payload", ["encoded", "raw"])
def test_extract_of_a_url_writes_what_extract_of_the_local_dataset_writes(packed, payload, tmp_path, monkeypatch):
    from support.storage_servers import served_as_a_user

    server = served_as_a_user(packed[payload], tmp_path / "root", monkeypatch, "ds.lmdb")
    try:
        assert main(["extract", "s3://bucket/ds.lmdb", str(tmp_path / "remote"), "--cache-dir",
                     str(tmp_path / "cache"), "-q"]) == 0
    finally:
        server.stop()
    extract(packed[payload], tmp_path / "local", progress=False)
    local, remote = files_under(tmp_path / "local"), files_under(tmp_path / "remote")
    assert [p.relative_to(tmp_path / "local") for p in local] == [p.relative_to(tmp_path / "remote") for p in remote]
    assert len(local) == 15 and all(a.read_bytes() == b.read_bytes() for a, b in zip(local, remote, strict=True))
