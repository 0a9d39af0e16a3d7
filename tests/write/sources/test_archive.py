"""Archives read in place: tar, a tar of class tars, zip, tar.gz; bad members are errors naming them."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from packer import PackerError, convert, open_dataset
from packer.tools.verify import verify
from packer.write.scan import scan_folder
from tests.support.archives import lying_tgz, zero_bomb_tgz
from tests.support.cli import run_cli
from tests.support.imagesets import make_imagefolder
from tests.support.memlimit import limited_convert


@pytest.fixture(scope="module")
def imgs(tmp_path_factory) -> Path:
    root = make_imagefolder(tmp_path_factory.mktemp("a") / "imgs", classes=3, per_class=4)
    (root / "class_1" / "sub").mkdir()
    (root / "class_1" / "sub" / "deep.jpg").write_bytes((root / "class_0" / "img_000.jpg").read_bytes())
    return root


def _files(root: Path) -> list[Path]:
    return sorted((p for p in root.rglob("*") if p.is_file()), reverse=True)  # not ImageFolder order on purpose


def make_tar(imgs: Path, path: Path, mode: str = "w") -> Path:
    with tarfile.open(path, mode) as tf:
        for p in _files(imgs):
            tf.add(p, arcname=p.relative_to(imgs).as_posix())
    return path


def make_nested(imgs: Path, path: Path) -> Path:
    with tarfile.open(path, "w") as outer:
        for cls in sorted(imgs.iterdir(), reverse=True):
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as inner:
                for p in _files(cls):
                    inner.add(p, arcname=p.relative_to(cls).as_posix())
            info = tarfile.TarInfo(f"{cls.name}.tar")
            info.size = len(buf.getvalue())
            outer.addfile(info, io.BytesIO(buf.getvalue()))
    return path


def make_zip(imgs: Path, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for p in _files(imgs):
            zf.write(p, p.relative_to(imgs).as_posix())
    return path


def _same_as_folder(out: Path, imgs: Path) -> None:
    """Keys, labels, classes and bytes as converting the folder gives, in ImageFolder order."""
    ds, scan = open_dataset(out), scan_folder(imgs)
    assert ds.classes == scan.classes
    assert [s for s in ds.samples] == list(zip(scan.rel_paths, scan.labels.tolist()))
    for i, rel in enumerate(scan.rel_paths):
        assert bytes(ds.read_payload(i)) == (imgs / rel).read_bytes()


@pytest.mark.parametrize("make", [make_tar, make_nested, make_zip], ids=["tar", "nested", "zip"])
def test_archive_converts_like_the_folder_and_verifies(imgs, tmp_path, make):
    archive = make(imgs, tmp_path / ("a.zip" if make is make_zip else "a.tar"))
    res = convert(archive, tmp_path / "o.lmdb", order="source", workers=2, progress=False)
    if make is make_nested:  # a class tar holds its class folder's contents
        assert res.num_samples == len(scan_folder(imgs))
    _same_as_folder(res.output, imgs)
    assert open_dataset(res.output).manifest.source_type == "archive"
    assert verify(res.output, against=archive).ok
    assert not list(tmp_path.glob("*.partial")) and sorted(p.name for p in tmp_path.iterdir()) == [archive.name,
                                                                                                    "o.lmdb"]


def test_tar_gz_is_streamed_in_stored_order(imgs, tmp_path):
    archive = make_tar(imgs, tmp_path / "a.tgz", "w:gz")
    with pytest.raises(PackerError, match="only be read in its stored order: add order='source'"):
        convert(archive, tmp_path / "o.lmdb", progress=False)
    res = convert(archive, tmp_path / "o.lmdb", order="source", workers=2, progress=False)
    ds = open_dataset(res.output)
    stored = [p.relative_to(imgs).as_posix() for p in _files(imgs)]
    assert [rel for rel, _ in ds.samples] == stored  # the archive's order
    for i, rel in enumerate(stored):
        assert bytes(ds.read_payload(i)) == (imgs / rel).read_bytes()
    assert verify(res.output, against=archive).ok


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, len(data)
    tf.addfile(info, io.BytesIO(data) if data else None)


def test_bad_tar_members_are_errors_naming_them(imgs, tmp_path):
    good = (imgs / "class_0" / "img_000.jpg").read_bytes()
    archive = tmp_path / "bad.tar"
    with tarfile.open(archive, "w") as tf:
        _add(tf, "cat/ok.jpg", good)
        _add(tf, "cat/link.jpg", kind=tarfile.SYMTYPE, link="/etc/passwd")
        _add(tf, "cat/hard.jpg", kind=tarfile.LNKTYPE, link="cat/ok.jpg")
        _add(tf, "cat/dev.jpg", kind=tarfile.CHRTYPE)
        _add(tf, "../escape.jpg", good)
        _add(tf, "/abs/x.jpg", good)
        _add(tf, "cat/ok.jpg", good)  # a second copy under the same name
        _add(tf, "cat/broken.jpg", good[:100])
        _add(tf, "cat/.hidden.jpg", good)
        _add(tf, "cat/last.jpg", good)
    raw = archive.read_bytes()
    end = raw.index(good, raw.index(b"cat/last.jpg")) + 200  # cut inside the last member's data
    archive.write_bytes(raw[:end])
    res = convert(archive, tmp_path / "o.lmdb", workers=0, progress=False)
    assert res.num_samples == 1
    errors = {e["location"]: e["reason"] for e in json.loads((res.output / "errors.json").read_text())["errors"]}
    assert "symbolic link" in errors["bad.tar: member cat/link.jpg"]
    assert "hard link" in errors["bad.tar: member cat/hard.jpg"]
    assert "device" in errors["bad.tar: member cat/dev.jpg"]
    assert "'..'" in errors["bad.tar: member ../escape.jpg"]
    assert "absolute" in errors["bad.tar: member /abs/x.jpg"]
    assert "twice" in errors["bad.tar: member cat/ok.jpg"]
    assert "truncated" in errors["bad.tar: member cat/last.jpg"]
    assert any("cat/broken.jpg" in k for k in errors)  # a damaged JPEG: found when decoded, located too
    assert not (tmp_path / "escape.jpg").exists() and not Path("/abs").exists()
    assert verify(res.output, against=archive).ok


def test_bad_zip_members_are_errors_naming_them(imgs, tmp_path):
    good = (imgs / "class_0" / "img_000.jpg").read_bytes()
    archive = tmp_path / "bad.zip"
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("cat/ok.jpg", good)
        zf.writestr("cat/crc.jpg", good, compress_type=zipfile.ZIP_STORED)
        zf.writestr("cat/bomb.jpg", bytes(50 << 20))
        link = zipfile.ZipInfo("cat/link.jpg")
        link.external_attr = (0o120777 << 16)
        zf.writestr(link, "/etc/passwd")
        zf.writestr("../up.jpg", good)
    raw = bytearray(archive.read_bytes())
    at = raw.index(b"cat/crc.jpg") + len("cat/crc.jpg") + 40  # inside its compressed data: the CRC won't match
    raw[at] ^= 0xFF
    archive.write_bytes(bytes(raw))
    res = convert(archive, tmp_path / "o.lmdb", workers=0, progress=False)
    assert res.num_samples == 1
    errors = {e["location"]: e["reason"] for e in json.loads((res.output / "errors.json").read_text())["errors"]}
    assert set(errors) == {f"bad.zip: member {m}" for m in ("cat/crc.jpg", "cat/bomb.jpg", "cat/link.jpg",
                                                              "../up.jpg")}
    assert "zip bomb" in errors["bad.zip: member cat/bomb.jpg"]
    assert "symbolic link" in errors["bad.zip: member cat/link.jpg"]
    assert "Bad CRC-32" in errors["bad.zip: member cat/crc.jpg"]


@pytest.mark.parametrize("name, data", [("junk.tar", b"x" * 1000), ("junk.zip", b"PK not a zip"),
                                        ("junk.tgz", b"\x1f\x8b nope"), ("empty.tar", b"")])
def test_an_unreadable_archive_is_one_clear_error(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    proc = run_cli("convert", tmp_path / name, "--order", "source", "-o", tmp_path / "o.lmdb", "-q")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"packer: error: {tmp_path / name}: ") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "o.lmdb").exists() and not list(tmp_path.glob("*.partial"))


def test_nested_tar_cli_and_verify(imgs, tmp_path):
    archive = make_nested(imgs, tmp_path / "train.tar")
    proc = run_cli("convert", archive, "--to", "hdf5", "-o", tmp_path / "o.hdf5", "-q")
    assert proc.returncode == 0, proc.stderr
    assert run_cli("verify", tmp_path / "o.hdf5", "--against", archive, "-q").returncode == 0
    assert np.array_equal(np.bincount(open_dataset(tmp_path / "o.hdf5").targets), [4, 5, 4])


@pytest.mark.parametrize(("mib", "why"), [(640, "inflates more than 200:1"), (2048, "declares 2,147,483,648 bytes")],
                         ids=["ratio", "declared"])
def test_a_tar_gz_member_inflating_like_a_bomb_is_refused_unread(imgs, tmp_path, mib, why):
    """A ~2 MB .tar.gz whose member inflates to 2 GiB of zeros was read whole (OOM-killed at 1, 3 and 5 GB), and
    its scan inflated it for minutes. An image member declaring more than an image within the pixel limit
    takes is refused from its header; one inflating more than 200:1 stops the stream there (nothing after it
    can be reached without inflating it). All in a child allowed 512 MiB, less than the member."""
    a, b = (imgs / "class_0" / "img_000.jpg").read_bytes(), (imgs / "class_1" / "img_000.jpg").read_bytes()
    src = zero_bomb_tgz(tmp_path / "bomb.tar.gz", [("cat/a.jpg", a)], "cat/bomb.png", mib, [("cat/b.jpg", b)])
    assert src.stat().st_size < (3 << 20)
    status, report = limited_convert(src, tmp_path / "o.lmdb", limit=512 << 20, order="source")
    assert status == "ok", report
    errors = {e["path"]: e["reason"] for e in report["errors"]}
    assert set(errors) == {"cat/bomb.png", "(after 2 members)"}
    assert errors["cat/bomb.png"].startswith(why) and errors["cat/bomb.png"].endswith("not read")
    assert errors["(after 2 members)"].startswith("not read: member cat/bomb.png before it inflates more than 200:1")
    ds = open_dataset(tmp_path / "o.lmdb")
    assert ds.relpaths == ["cat/a.jpg"] and bytes(ds.read_payload(0)) == a


def test_a_tar_gz_member_lying_about_its_size_is_refused_from_its_header(imgs, tmp_path):
    """A header declaring 2 GiB with a few KB behind it: refused by its declared size, never read."""
    a = (imgs / "class_0" / "img_000.jpg").read_bytes()
    src = lying_tgz(tmp_path / "liar.tar.gz", [("cat/a.jpg", a)], "cat/liar.jpg", 2 << 30, a)
    status, report = limited_convert(src, tmp_path / "o.lmdb", limit=512 << 20, order="source")
    assert status == "ok", report
    errors = {e["path"]: e["reason"] for e in report["errors"]}
    assert errors["cat/liar.jpg"].startswith("declares 2,147,483,648 bytes, more than an image within the pixel "
                                             "limit can take")
    assert set(errors) == {"cat/liar.jpg", "(after 2 members)"} and "truncated" in errors["(after 2 members)"]
    assert open_dataset(tmp_path / "o.lmdb").relpaths == ["cat/a.jpg"]


def test_a_tar_gz_without_order_source_is_refused_before_it_is_read(tmp_path):
    """The usage error comes before the scan (which once inflated a 2 GiB member for 38 s first): a file that
    is no gzip at all still gets it, so nothing of it was read."""
    bad = tmp_path / "x.tar.gz"
    bad.write_bytes(b"not gzip" * 100)
    proc = run_cli("convert", bad, "-o", tmp_path / "o.lmdb", "-q")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "can only be read in its stored order: add --order source" in proc.stderr
