"""Sources at a URL (write/sources/remote.py): a prefix laid out as ImageFolder converts as its local folder does.

moto's S3 server for correctness, the emulated store (packer/storage/emulate.py) where the server's counts are
checked: pages of the listing, one GET per object, many in flight, faults injected per object.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from support.foreign import items, make_hf, make_wds
from support.imagesets import jpeg_bytes, tiny_photos
from support.interrupt import kill_after_shards
from support.storage_servers import Emulated, s3_store, upload, user_environment, wait_until

import packer
from packer.cli import main
from packer.errors import IndexingWarning, OptionError, PackerError
from packer.storage.emulate import Fault
from packer.write.scan import scan_folder, scan_names
from packer.write.sources.registry import scan_source
from packer.write.sources.remote import Absent, Fetched, RemoteReader
from tests.write.test_resume import manifest_without_time, tree_digest

REPO = Path(__file__).resolve().parents[3]


def make_tree(root: Path, extra: dict[str, bytes] | None = None) -> Path:
    """An ImageFolder with what its rules decide on: nested folders (ordered by the folder's path), classes 'a' and
    'a-b' (sorted otherwise than their files' paths), an upper-case extension, a hidden image and folder,
    non-images, a file outside the classes and an unfinished packer output inside."""
    rng = np.random.default_rng(0)
    files = {
        "a/3.jpg": jpeg_bytes(rng, 12, 16), "a/z/1.jpg": jpeg_bytes(rng, 10, 8), "a/b/c/2.JPG": jpeg_bytes(rng, 8, 8),
        "a/.hidden.jpg": jpeg_bytes(rng, 8, 12), "a/notes.txt": b"not an image", "a-b/x y.jpg": jpeg_bytes(rng, 9, 9),
        "a-b/é.jpeg": jpeg_bytes(rng, 16, 16), "README.md": b"outside the classes",
        "c/.cache/k.jpg": jpeg_bytes(rng, 8, 8), "c/d.jpg": jpeg_bytes(rng, 8, 16),
        "c/old.lmdb.partial/s.jpg": jpeg_bytes(rng, 8, 8),
        **(extra or {}),
    }
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def names_below(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("skip_hidden", [False, True])
def test_names_scan_as_the_folder_holding_them(tmp_path, skip_hidden):
    tree = make_tree(tmp_path / "t")
    packer.convert(tree / "a", tmp_path / "t" / "c" / "inner.lmdb", workers=0, progress=False)  # a dataset inside
    local = scan_folder(tree, skip_hidden=skip_hidden)
    named = scan_names(tree, names_below(tree), skip_hidden=skip_hidden)
    assert (named.classes, named.rel_paths, named.labels.tolist()) == (local.classes, local.rel_paths,
                                                                       local.labels.tolist())
    assert (named.ignored, named.not_images) == (local.ignored, local.not_images)
    flat = make_tree(tmp_path / "flat", {})
    for folder in ("a", "a-b", "c"):
        shutil.rmtree(flat / folder)
    (flat / "x.png").write_bytes(b"png")
    local, named = scan_folder(flat, skip_hidden=skip_hidden), scan_names(flat, names_below(flat),
                                                                         skip_hidden=skip_hidden)
    assert (named.classes, named.rel_paths, named.labels.tolist()) == ([], ["x.png"], [-1])
    assert (named.rel_paths, named.ignored) == (local.rel_paths, local.ignored)
    with pytest.raises(PackerError, match="no images found"):
        scan_names(tmp_path, ["notes.txt"])
    with pytest.raises(PackerError, match="a packed dataset"):
        scan_names(tmp_path, ["manifest.json", "a/x.jpg"])


def _same_dataset(a: Path | str, b: Path | str) -> None:
    """Index order, keys, labels, classes and every payload's bytes equal."""
    with warnings.catch_warnings():  # records left out: both say so alike
        warnings.simplefilter("ignore", IndexingWarning)
        da, db = packer.open_dataset(a), packer.open_dataset(b)
    try:
        assert da.classes == db.classes
        assert da.index.rel_paths() == db.index.rel_paths()
        assert da.index.labels.tolist() == db.index.labels.tolist()
        assert all(bytes(da.read_payload(i)) == bytes(db.read_payload(i)) for i in range(len(da)))
    finally:
        da.close()
        db.close()


def test_a_prefix_converts_as_its_local_folder(moto_endpoint, bucket, tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "train")
    with s3_store(moto_endpoint, f"s3://{bucket}/train") as store:
        upload(store, tree)
    user_environment(monkeypatch, moto_endpoint)
    local = packer.convert(tree, tmp_path / "local.lmdb", workers=0, progress=False)
    remote = packer.convert(f"s3://{bucket}/train/", tmp_path / "remote.lmdb", workers=2, progress=False)
    assert remote.num_samples == local.num_samples == 8
    assert (remote.errors, remote.ignored, remote.not_images) == ([], local.ignored, local.not_images)
    _same_dataset(remote.output, local.output)
    with packer.open_dataset(remote.output) as ds:  # sample i: ImageFolder's i, its object's bytes exactly
        assert [bytes(ds.read_payload(i)) for i in range(len(ds))] == [
            (tree / rel).read_bytes() for rel in scan_folder(tree).rel_paths]
    manifest = json.loads((Path(remote.output) / "manifest.json").read_text())
    assert (manifest["source"], manifest["source_type"]) == (f"s3://{bucket}/train/", "folder")


@pytest.fixture
def served(tmp_path, monkeypatch):
    """An emulated store over ``tmp_path/root`` listing 7 keys a page, with 50 ms before each first byte."""
    srv = Emulated(tmp_path / "root", page_size=7, latency=0.05)
    user_environment(monkeypatch, srv.server.endpoint)
    yield srv
    srv.stop()


def test_the_listing_is_paged_and_objects_are_fetched_many_at_once(served, tmp_path):
    tiny_photos(tmp_path / "root" / "train")
    before = served.server.stats.lists
    result = packer.convert("s3://bucket/train", tmp_path / "out.lmdb", workers=0, progress=False)
    stats = served.server.stats.settled()
    assert result.num_samples == 60 and result.errors == []
    assert stats["lists"] - before >= 60 // 7  # every page (a page of 7 keys)
    assert stats["gets"] == 60  # one GET per object, nothing twice
    assert stats["max_active"] >= 16  # many in flight (64 asked for), not one round trip per file
    _same_dataset(result.output, packer.convert(tmp_path / "root" / "train", tmp_path / "local.lmdb", workers=0,
                                                progress=False).output)


def test_objects_that_fail_are_listed_in_errors_json_with_their_url(served, tmp_path):
    tiny_photos(tmp_path / "root" / "train", classes=2, per_class=5)
    (tmp_path / "root" / "train" / "c1" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg at all")
    served.faults.add(Fault("status", 404, "NoSuchKey"), key="train/c0/001.jpg", times=-1)
    served.faults.add(Fault("status", 403, "AccessDenied"), key="train/c1/003.jpg", times=-1)
    result = packer.convert("s3://bucket/train/", tmp_path / "out.lmdb", workers=0, progress=False)
    assert result.num_samples == 8
    errors = {e["path"]: e for e in json.loads((Path(result.output) / "errors.json").read_text())["errors"]}
    assert sorted(errors) == ["c0/001.jpg", "c1/003.jpg", "c1/bad.jpg"]
    for rel, entry in errors.items():
        assert entry["location"] == f"s3://bucket/train/{rel}"
    assert errors["c0/001.jpg"]["reason"] == ("s3://bucket/train/c0/001.jpg: no such object (404): listed, then gone "
                                              "before it was read")
    assert errors["c1/003.jpg"]["reason"].startswith("s3://bucket/train/c1/003.jpg: access denied (403)")
    assert errors["c1/bad.jpg"]["reason"].startswith("not an image format Pillow reads")


def test_an_object_replaced_after_the_listing_is_an_error_never_its_new_bytes(served, tmp_path):
    tiny_photos(tmp_path / "root" / "train", classes=1, per_class=4)
    scan = scan_source("s3://bucket/train/")
    served.write("train/c0/002.jpg", b"new bytes")
    reader = scan.source_reader()
    assert isinstance(reader, RemoteReader)
    got = {rel: loc for rel, _, loc in reader.admitted(scan.records())}
    assert all(isinstance(loc, Fetched) for loc in got.values())
    assert got["c0/002.jpg"].data is None and "changed" in str(got["c0/002.jpg"].error)
    assert got["c0/001.jpg"].data == (tmp_path / "root" / "train" / "c0" / "001.jpg").read_bytes()
    reader.close()


def test_the_command_line_converts_a_prefix_and_refuses_what_it_cannot(served, tmp_path, monkeypatch, capsys):
    tiny_photos(tmp_path / "root" / "train", classes=2, per_class=3)
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "s3://bucket/train/", "--to", "lmdb", "-o", "out.lmdb", "-q", "--workers", "0"]) == 0
    with packer.open_dataset(tmp_path / "out.lmdb") as ds:
        assert ds.classes == ["c0", "c1"]
    assert main(["convert", "s3://bucket/train/", "-o", "s.lmdb", "--split", "0.5", "-q", "--workers", "0"]) == 0
    for part, count in (("train", 4), ("val", 2)):
        with pytest.warns(IndexingWarning, match="left out by --split"), \
                packer.open_dataset(tmp_path / f"s.lmdb-{part}") as ds:
            assert len(ds) == count
    capsys.readouterr()
    assert main(["convert", "s3://bucket/train/", "--to", "lmdb", "-q"]) == 2
    assert "a source at a URL needs the output named" in capsys.readouterr().err
    assert main(["convert", "s3://bucket/train/", "--source-type", "recordio", "-o", "x.lmdb", "-q"]) == 2
    assert "--source-type recordio reads one MXNet .rec object" in capsys.readouterr().err  # a prefix is not one
    assert not os.path.exists(tmp_path / "s3:")
    with pytest.raises(PackerError, match="no objects below this prefix"):
        packer.convert("s3://bucket/nothing/", tmp_path / "n.lmdb", progress=False)
    (tmp_path / "root" / "notes" / "a").mkdir(parents=True)
    (tmp_path / "root" / "notes" / "a" / "x.txt").write_text("not an image")
    assert main(["convert", "s3://bucket/notes/", "--to", "lmdb", "-o", "t.lmdb", "-q"]) == 2
    assert capsys.readouterr().err.startswith("packer: error: s3://bucket/notes: no images found")  # not s3:/


def test_if_changed_sees_a_replaced_object(served, tmp_path):
    tiny_photos(tmp_path / "root" / "train", classes=1, per_class=3)
    url, out = "s3://bucket/train/", tmp_path / "out.lmdb"
    packer.convert(url, out, workers=0, progress=False)
    gets = served.server.stats.gets
    assert packer.convert(url, out, workers=0, progress=False, if_changed=True).num_samples == 3
    assert served.server.stats.gets == gets  # unchanged: nothing fetched
    served.write("train/c0/001.jpg", (tmp_path / "root" / "train" / "c0" / "000.jpg").read_bytes())
    with pytest.raises(PackerError, match="out of date"):
        packer.convert(url, out, workers=0, progress=False, if_changed=True)
    packer.convert(url, out, workers=0, progress=False, if_changed=True, overwrite=True)
    assert served.server.stats.gets > gets
    with packer.open_dataset(out) as ds:
        assert bytes(ds.read_payload(1)) == (tmp_path / "root" / "train" / "c0" / "000.jpg").read_bytes()


def _list_of(root: Path, name: str, prefix: str = "") -> list[str]:
    """A Caffe list (``path label``) of the images below ``root`` in ImageFolder's order, each path after
    ``prefix``; written to ``root/name``."""
    scan = scan_folder(root)
    lines = [f"{prefix}{rel} {label}" for rel, label in zip(scan.rel_paths, scan.labels.tolist())]
    (root / name).write_text("\n".join(lines) + "\n")
    return lines


def test_a_list_file_at_a_url_reads_objects_below_its_prefix(served, tmp_path):
    train = tiny_photos(tmp_path / "root" / "train", classes=2, per_class=6)
    lines = _list_of(train, "list.txt")
    (train / "list.txt").write_text("\n".join(
        lines + ["c0/gone.jpg 0", "s3://bucket/other/x.jpg 1", "s3://bucket/train/c1/000.jpg 1"]) + "\n")
    local = packer.convert(train / "list.txt", tmp_path / "local.lmdb", workers=0, progress=False)
    stats = served.server.stats.settled()
    remote = packer.convert("s3://bucket/train/list.txt", tmp_path / "remote.lmdb", workers=2, progress=False)
    after = served.server.stats.settled()
    assert remote.num_samples == local.num_samples == 12
    _same_dataset(remote.output, local.output)
    assert after["gets"] - stats["gets"] == 1 + 12  # the list, then each object once (in flight together: the
    # prefix's reader, whose concurrency test_the_listing_is_paged_and_objects_are_fetched_many_at_once counts)
    errors = {e["path"]: e for e in json.loads((Path(remote.output) / "errors.json").read_text())["errors"]}
    assert sorted(errors) == ["c0/gone.jpg", "c1/000.jpg", "s3://bucket/other/x.jpg"]
    assert errors["c0/gone.jpg"]["location"] == "s3://bucket/train/c0/gone.jpg (list.txt line 13)"
    assert "no such object" in errors["c0/gone.jpg"]["reason"]
    assert errors["s3://bucket/other/x.jpg"]["reason"] == "a URL, not below s3://bucket/train/"
    assert errors["c1/000.jpg"]["reason"].startswith("listed twice (first on line 7)")
    manifest = json.loads((Path(remote.output) / "manifest.json").read_text())
    assert (manifest["source"], manifest["source_type"]) == ("s3://bucket/train/list.txt", "list")


def test_a_local_list_naming_urls_or_a_url_root(served, tmp_path):
    train = tiny_photos(tmp_path / "root" / "train", classes=2, per_class=4)
    _list_of(train, "plain.txt")
    local = packer.convert(train / "plain.txt", tmp_path / "local.lmdb", workers=0, progress=False)
    named = tmp_path / "named"
    named.mkdir()
    _list_of(train, "urls.txt", prefix="s3://bucket/train/")
    shutil.move(train / "urls.txt", named / "urls.txt")
    by_url = packer.convert(named / "urls.txt", tmp_path / "by_url.lmdb", workers=0, progress=False)
    _same_dataset(by_url.output, local.output)
    shutil.copy(train / "plain.txt", named / "plain.txt")
    by_root = packer.convert(named / "plain.txt", tmp_path / "by_root.lmdb", root="s3://bucket/train/", workers=0,
                             progress=False)
    _same_dataset(by_root.output, local.output)
    manifest = json.loads((Path(by_root.output) / "manifest.json").read_text())
    assert manifest["source_options"]["root"] == "s3://bucket/train/"
    (named / "two.txt").write_text("s3://bucket/train/c0/000.jpg 0\ns3://other/c1/000.jpg 1\n")
    with pytest.raises(PackerError, match="share no bucket"):
        packer.convert(named / "two.txt", tmp_path / "two.lmdb", workers=0, progress=False)
    (named / "mixed.txt").write_text("c1/000.jpg 1\ns3://bucket/train/c0/000.jpg 0\n")  # a local root then
    shutil.copytree(train / "c1", named / "c1")
    mixed = packer.convert(named / "mixed.txt", tmp_path / "mixed.lmdb", workers=0, progress=False)
    assert mixed.num_samples == 1
    errors = json.loads((Path(mixed.output) / "errors.json").read_text())["errors"]
    assert [(e["path"], e["reason"]) for e in errors] == [
        ("s3://bucket/train/c0/000.jpg", f"a URL, while the paths are relative to the folder {named} (--root)")]


def test_webdataset_shards_by_url_convert_as_the_local_shards(served, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # this test's temp folder: others run at once
    (tmp_path / "tmp").mkdir()
    shards = make_wds(tmp_path / "root" / "shards", items(14), per_shard=4)  # 4 shards, each under 8 MB
    local = packer.convert(f"{tmp_path}/root/shards/shards-{{000000..000003}}.tar", tmp_path / "local.lmdb",
                           workers=0, progress=False)
    before = served.server.stats.settled()
    for n, src in enumerate(["s3://bucket/shards/", "s3://bucket/shards/shards-{000000..000003}.tar"]):
        remote = packer.convert(src, tmp_path / f"remote{n}.lmdb", workers=2, progress=False)
        assert remote.num_samples == local.num_samples == 14
        _same_dataset(remote.output, local.output)
        manifest = json.loads((Path(remote.output) / "manifest.json").read_text())
        assert (manifest["source"], manifest["source_type"]) == (src, "webdataset")
        assert manifest["fields"] == json.loads((Path(local.output) / "manifest.json").read_text())["fields"]
    after = served.server.stats.settled()
    assert after["gets"] - before["gets"] == 2 * len(shards)  # each shard once a conversion (< one 8 MB chunk)
    assert not list(Path(tempfile.gettempdir()).glob("packer-source-*"))  # the local copies are gone
    pattern = "s3://bucket/shards/shards-{000000..000004}.tar"  # one shard more than there are
    result = packer.convert(pattern, tmp_path / "more.lmdb", workers=0, progress=False)
    errors = json.loads((Path(result.output) / "errors.json").read_text())["errors"]
    assert result.num_samples == 14 and "shard missing" in errors[0]["reason"]


def test_an_archive_and_parquet_by_url(served, tmp_path):
    tree = tiny_photos(tmp_path / "imgs", classes=2, per_class=3)
    (tmp_path / "root" / "arch").mkdir(parents=True)
    with tarfile.open(tmp_path / "root" / "arch" / "train.tar.gz", "w:gz") as tar:
        tar.add(tree, arcname="train")
    local = packer.convert(tmp_path / "root" / "arch" / "train.tar.gz", tmp_path / "local.lmdb", workers=0,
                           progress=False, order="source")
    assert local.num_samples == 6
    gets = served.server.stats.settled()["gets"]
    with pytest.raises(OptionError, match=r"^s3://bucket/arch/train.tar.gz: a compressed archive can only be read in"):
        packer.convert("s3://bucket/arch/train.tar.gz", tmp_path / "tgz.lmdb", progress=False)
    assert served.server.stats.settled()["gets"] == gets  # refused by its name, before a download
    remote = packer.convert("s3://bucket/arch/train.tar.gz", tmp_path / "tgz.lmdb", workers=0, progress=False,
                            order="source")  # as the local archive: read in its stored order
    _same_dataset(remote.output, local.output)
    _, parquet = make_hf(tmp_path / "hf", items(9), ["a", "b", "c"], rows_per_group=4)
    (tmp_path / "root" / "hf").mkdir()
    shutil.copy(parquet, tmp_path / "root" / "hf" / "data.parquet")
    local = packer.convert(parquet, tmp_path / "hf_local.lmdb", workers=0, progress=False)
    remote = packer.convert("s3://bucket/hf/data.parquet", tmp_path / "hf_remote.lmdb", workers=0, progress=False)
    _same_dataset(remote.output, local.output)
    assert json.loads((Path(remote.output) / "manifest.json").read_text())["source_type"] == "hf"
    with pytest.raises(PackerError, match="no such object"):
        packer.convert("s3://bucket/hf/nothing.parquet", tmp_path / "none.lmdb", progress=False)


def test_resume_of_a_killed_prefix_conversion_fetches_only_what_is_left(served, tmp_path):
    tiny_photos(tmp_path / "root" / "train", classes=3, per_class=20)
    reference = Path(packer.convert("s3://bucket/train/", tmp_path / "ref.lmdb", workers=0, shard_bytes=4000,
                                    progress=False).output)
    out = tmp_path / "o.lmdb"
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the served store's endpoint and credentials
    cmd = [sys.executable, "-m", "packer", "convert", "s3://bucket/train/", "-o", str(out), "--shard-size", "4000",
           "--workers", "1", "-q"]
    done = kill_after_shards(cmd, env, out.with_name("o.lmdb.partial") / "journal", shards=2)
    assert done >= 2 and not out.exists()
    gets = served.server.stats.settled()["gets"]
    res = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert tree_digest(out) == tree_digest(reference)
    assert manifest_without_time(out) == manifest_without_time(reference)
    assert served.server.stats.settled()["gets"] - gets < 60  # the packed shards' objects are not fetched again


def test_dask_workers_fetch_their_own_objects(served, tmp_path, monkeypatch):
    distributed = pytest.importorskip("distributed", reason="needs the packer[dask] extra")
    from packer.write.cluster import open_client

    tiny_photos(tmp_path / "root" / "train", classes=3, per_class=10)
    (tmp_path / "root" / "train" / "c1" / "bad.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    local = packer.convert(tmp_path / "root" / "train", tmp_path / "local.lmdb", workers=0, shard_bytes=4000,
                           progress=False).output
    with open_client("local:2") as client:  # worker processes: the store's endpoint from the environment
        assert isinstance(client, distributed.Client)
        before = served.server.stats.settled()["gets"]

        def in_the_driver(self, records):
            raise AssertionError("the driver fetched objects: they would cross it to the workers")

        monkeypatch.setattr(RemoteReader, "admitted", in_the_driver)  # this process only (workers are spawned)
        dask = Path(packer.convert("s3://bucket/train/", tmp_path / "dask.lmdb", client=client, shard_bytes=4000,
                                   progress=False).output)
        assert served.server.stats.settled()["gets"] - before == 31  # each object once, by the workers' tasks
        with pytest.raises(OptionError, match="not converted on a cluster yet"):
            packer.convert("s3://bucket/train/x.tar", tmp_path / "t.lmdb", client=client, progress=False)
    assert len(list(dask.glob("*.lmdb"))) + len(list(dask.glob("**/data.mdb"))) >= 3
    errors = json.loads((dask / "errors.json").read_text())["errors"]
    assert [(e["path"], e["location"]) for e in errors] == [("c1/bad.jpg", "s3://bucket/train/c1/bad.jpg")]
    _same_dataset(dask, local)


def test_objects_are_fetched_in_batches_each_record_its_own_bytes_or_error(served, tmp_path, monkeypatch):
    """Small objects: GETs are started 16 at a time with one future per batch (not one each); every record still
    gets its own object's bytes, or its own error, in order; records without a listing pass through."""
    root = tiny_photos(tmp_path / "root" / "train", classes=2, per_class=20)
    served.faults.add(Fault("status", 404, "NoSuchKey"), key="train/c1/007.jpg", times=-1)
    scan = scan_source("s3://bucket/train/")
    reader = scan.source_reader()
    assert isinstance(reader, RemoteReader) and reader.batch == 16
    batches: list[int] = []
    by_batch = reader.store.submit_gets
    monkeypatch.setattr(reader.store, "submit_gets",
                        lambda objects, lanes: batches.append(len(objects)) or by_batch(objects, lanes))
    monkeypatch.setattr(reader.store, "submit_get", None)  # never one GET at a time here
    records = list(scan.records())
    records.insert(5, ("c0/absent.jpg", 0, Absent(3)))
    got = list(reader.admitted(records))
    assert [rel for rel, _, _ in got] == [rel for rel, _, _ in records]
    assert got[5][2] == Absent(3) and sum(batches) == 40 and max(batches) == 16 and len(batches) <= 4
    for rel, _, loc in got:
        if rel == "c1/007.jpg":
            assert loc.data is None and "no such object (404)" in str(loc.error)
        elif rel != "c0/absent.jpg":
            assert loc.data == (root / rel).read_bytes() and loc.error is None
    assert served.server.stats.settled()["gets"] >= 40


def test_gets_stay_at_their_concurrency_while_the_consumer_holds_a_record(served, tmp_path):
    """The client's loop starts the next GET as one lands, not when the consumer next asks: with the consumer
    holding its first record, the server still answers every GET of the window asked ahead (``ahead_objects``),
    never more than ``in_flight`` at once and reaching it; every record then gets its own bytes, in order."""
    root = tiny_photos(tmp_path / "root" / "train", classes=2, per_class=20)
    scan = scan_source("s3://bucket/train/")
    records = list(scan.records())
    reader = RemoteReader(served.store("train/"), in_flight=4, batch=2, ahead_objects=24)
    before = served.server.stats.settled()["gets"]
    admitted = reader.admitted(records)
    first = next(admitted)
    wait_until(lambda: served.server.stats.snapshot()["gets"] - before >= 24,
               "24 GETs answered while the consumer held its first record")
    stats = served.server.stats.settled()
    assert stats["gets"] - before == 24 and stats["max_waiting"] == 4  # the window, 4 at once (the server's count)
    got = [first, *admitted]
    reader.close()
    assert [rel for rel, _, _ in got] == [rel for rel, _, _ in records]
    assert all(loc.data == (root / rel).read_bytes() and loc.error is None for rel, _, loc in got)
    stats = served.server.stats.settled()
    assert stats["gets"] - before == 40 and stats["max_waiting"] == 4
