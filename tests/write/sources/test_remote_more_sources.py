"""More sources at a URL (write/sources/spool.py, labels.py): a packer dataset and an MXNet ``.rec``/``.idx`` pair
in a bucket, fetched into the conversion's temporary folder (its free space checked first) and converted as their
local copies are; a ``--classes-file`` at a URL read from the store. Credentials by ``storage_options`` only.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from support.foreign import write_mxnet_rec
from support.imagesets import jpeg_bytes, make_imagefolder

import packer
from packer.cli import main
from packer.errors import PackerError
from tests.write.sources.test_remote_source import _same_dataset
from tests.write.sources.test_remote_storage_options import options, served  # noqa: F401 (the fixture)


def test_a_packer_dataset_in_a_bucket_converts_as_its_local_copy(served, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # this test's temp folder: others run at once
    (tmp_path / "tmp").mkdir()
    imgs = make_imagefolder(tmp_path / "imgs", classes=3, per_class=4, size=(16, 16))
    ds = Path(packer.convert(imgs, tmp_path / "ds.lmdb", workers=0, shard_bytes=4000, progress=False).output)
    shutil.copytree(ds, tmp_path / "root" / "ds.lmdb")
    local = packer.convert(ds, tmp_path / "local.hdf5", to="hdf5", workers=0, progress=False)
    for n, kw in enumerate(({}, {"source_type": "packed"})):  # found by its manifest, or named
        remote = packer.convert("s3://bucket/ds.lmdb", tmp_path / f"remote{n}.hdf5", to="hdf5", workers=1,
                                progress=False, storage_options=options(served), **kw)
        _same_dataset(remote.output, local.output)
        manifest = json.loads((Path(remote.output) / "manifest.json").read_text())
        assert (manifest["source"], manifest["source_type"]) == ("s3://bucket/ds.lmdb", "packed")
    assert list((tmp_path / "tmp").iterdir()) == []  # the local copy is gone
    shard = tmp_path / "root" / "ds.lmdb" / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(PackerError, match="shard-00000"):  # checked against its manifest, as a local dataset is
        packer.convert("s3://bucket/ds.lmdb", tmp_path / "bad.hdf5", to="hdf5", workers=0, progress=False,
                       storage_options=options(served), on_error="raise")


def test_the_local_copy_is_refused_up_front_without_room(served, tmp_path, monkeypatch):  # noqa: F811
    imgs = make_imagefolder(tmp_path / "imgs", classes=2, per_class=2, size=(16, 16))
    packer.convert(imgs, tmp_path / "root" / "ds.lmdb", workers=0, progress=False)
    gets = served.server.stats.settled()["gets"]
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(PackerError, match=r"^s3://bucket/ds.lmdb: its objects .* read whole from a local copy, and "):
        packer.convert("s3://bucket/ds.lmdb", tmp_path / "x.hdf5", to="hdf5", progress=False,
                       storage_options=options(served))
    assert served.server.stats.settled()["gets"] == gets  # nothing downloaded


def _rec(folder: Path) -> Path:
    rng = np.random.default_rng(4)
    records: list[tuple[bytes, float | list[float], int]] = [(jpeg_bytes(rng, 8 + i % 3, 8), float(i % 3), i)
                                                             for i in range(9)]
    folder.mkdir(parents=True, exist_ok=True)
    write_mxnet_rec(folder / "train.rec", records, keys=[f"k{i}" for i in range(9)])
    (folder / "classes.txt").write_text("cat\ndog\nfox\n")
    return folder / "train.rec"


def test_an_mxnet_rec_and_its_idx_in_a_bucket_and_a_classes_file_at_a_url(served, tmp_path, capsys):  # noqa: F811
    rec = _rec(tmp_path / "root" / "data")
    local = packer.convert(rec, tmp_path / "local.lmdb", workers=0, progress=False,
                           classes_file=str(rec.with_name("classes.txt")))
    gets = served.server.stats.settled()["gets"]
    for n, kw in enumerate(({}, {"source_type": "recordio"})):
        remote = packer.convert("s3://bucket/data/train.rec", tmp_path / f"r{n}.lmdb", workers=0, progress=False,
                                classes_file="s3://bucket/data/classes.txt", storage_options=options(served), **kw)
        _same_dataset(remote.output, local.output)
        manifest = json.loads((Path(remote.output) / "manifest.json").read_text())
        assert (manifest["source"], manifest["source_type"]) == ("s3://bucket/data/train.rec", "recordio")
        assert manifest["source_options"]["classes_file"] == "s3://bucket/data/classes.txt"  # as given
        with packer.open_dataset(remote.output) as got:
            assert got.classes == ["cat", "dog", "fox"] and "train.rec/k0" in got.index.rel_paths()
    assert served.server.stats.settled()["gets"] - gets == 2 * 3  # the .rec, the .idx and the classes file
    (tmp_path / "root" / "data" / "train.idx").unlink()  # no index: the records a walk finds, as locally
    plain = packer.convert("s3://bucket/data/train.rec", tmp_path / "walk.lmdb", workers=0, progress=False,
                           storage_options=options(served))
    assert plain.num_samples == 9
    flags = [a for k, v in options(served).items() for a in ("--storage-option", f"{k}={v}")]
    assert main(["convert", "s3://bucket/data/", "--source-type", "recordio", "-o", str(tmp_path / "p.lmdb"),
                 "-q", *flags]) == 2
    assert capsys.readouterr().err == ("packer: error: s3://bucket/data/: --source-type recordio reads one MXNet .rec "
                                       "object (its .idx beside it, when there): name the .rec, e.g. "
                                       "s3://bucket/data/train.rec\n")
    assert main(["convert", "s3://bucket/data/train.rec", "--classes-file", "s3://bucket/data/none.txt", "-o",
                 str(tmp_path / "n.lmdb"), "-q", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("packer: error: s3://bucket/data/none.txt: no such object") and len(err.splitlines()) == 1


def test_a_classes_file_at_a_url_for_a_list_file(served, tmp_path):  # noqa: F811
    root = tmp_path / "root" / "train"
    imgs = make_imagefolder(root, classes=2, per_class=3, size=(16, 16))
    rows = sorted(p.relative_to(imgs).as_posix() for p in imgs.rglob("*.jpg"))
    (root / "list.txt").write_text("".join(f"{r} {int(r.split('/')[0][-1])}\n" for r in rows))
    (root / "names.txt").write_text("alpha\nbeta\n")
    local = packer.convert(root / "list.txt", tmp_path / "local.lmdb", workers=0, progress=False,
                           classes_file=str(root / "names.txt"))
    for src in (root / "list.txt", "s3://bucket/train/list.txt"):
        remote = packer.convert(src, tmp_path / f"{len(str(src))}.lmdb", workers=0, progress=False,
                                classes_file="s3://bucket/train/names.txt", storage_options=options(served))
        _same_dataset(remote.output, local.output)
        with packer.open_dataset(remote.output) as got:
            assert got.classes == ["alpha", "beta"]


def test_an_object_beside_a_folder_of_its_name_is_refused_in_one_line(moto_endpoint, bucket, tmp_path, capsys):
    """S3 holds ``zz`` and ``zz/y`` at once, a folder cannot: the local copy of a packed dataset at a URL was a
    FileExistsError traceback (moto: the emulated store keeps its objects as files, so it cannot hold both)."""
    from support.storage_servers import s3_store, upload

    imgs = make_imagefolder(tmp_path / "imgs", classes=2, per_class=3)
    packer.convert(imgs, tmp_path / "ds.lmdb", workers=0, progress=False)
    store = s3_store(moto_endpoint, f"s3://{bucket}/ds.lmdb")
    upload(store, tmp_path / "ds.lmdb")
    store.put("zz", b"an object")
    store.put("zz/y", b"an object below a folder of the same name")
    flags = [a for k, v in {"endpoint": moto_endpoint, "aws_access_key_id": "testing",
                            "aws_secret_access_key": "testing", "region": "us-east-1"}.items()
             for a in ("--storage-option", f"{k}={v}")]
    assert main(["convert", f"s3://{bucket}/ds.lmdb", "--source-type", "packed", "--to", "hdf5", "-o",
                 str(tmp_path / "out.hdf5"), "-q", *flags]) == 2
    err = capsys.readouterr().err
    assert err == (f"packer: error: s3://{bucket}/ds.lmdb/zz: an object and a folder of objects of the same name; "
                   "a local copy cannot hold both (move one away)\n")
    assert not (tmp_path / "out.hdf5").exists()
