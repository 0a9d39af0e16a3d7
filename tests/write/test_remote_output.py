"""Outputs in object storage (packer/write/remote_output.py) against real servers: moto's S3 API for every format,
the emulated store (packer/storage/emulate.py) for counting PUTs, slowing the link and injecting faults. A real
``python -m packer convert -o s3://...`` is killed mid-upload and resumed; the dataset is read back by URL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.cli import run_cli
from support.fielded import SPECS, same_value, write_fielded
from support.imagesets import make_imagefolder
from support.interrupt import run_cli_at
from support.storage_servers import CREDENTIALS, FAST_POLICY, Emulated, killed_upload, s3_store

import packer
from packer.errors import InputNotFoundError, OptionError, OutputExistsError, PackerError
from packer.formats import FORMATS
from packer.layout.manifest import read_manifest
from packer.layout.partial import REMOTE_LOCK, REMOTE_PARTIAL
from packer.storage.emulate import Fault
from packer.write.convert import convert, convert_split
from packer.write.remote_output import RemoteOutput

FORMAT_OPTIONS: dict[str, dict] = {"mosaic": {"tile": "32x48"}}
SECRET = "SeCrEt-never-shown-0123456789"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("remote-out") / "imgs", classes=3, per_class=8)


def _options(endpoint: str) -> dict:
    return {**CREDENTIALS, "aws_secret_access_key": SECRET, "endpoint": endpoint}


def _convert(src, url: str, endpoint: str, tmp_path: Path, **kw):
    kw.setdefault("staging_dir", tmp_path / "staging")
    kw.setdefault("workers", 0)
    return convert(src, url, progress=False, storage_options=_options(endpoint), **kw)


def _local(src, tmp_path: Path, to: str = "lmdb", **kw) -> Path:
    out = tmp_path / f"local.{to}"
    convert(src, out, to=to, progress=False, workers=0, **kw)
    return out


def _files(manifest) -> dict[str, str]:
    return {f.name: f.sha256 for s in manifest.shards for f in s.files}


def _same_as_local(url: str, endpoint: str, local: Path, cache: Path) -> None:
    """The dataset at ``url`` opens and holds the local conversion's shards (sha256) and samples, byte for byte."""
    want = packer.open_dataset(local)
    with packer.open_dataset(url, cache_dir=cache, storage_options=_options(endpoint)) as ds:
        assert _files(ds.manifest) == _files(read_manifest(local)) and len(ds.manifest.shards) > 1
        assert (ds.classes, ds.targets) == (want.classes, want.targets)
        for i in range(len(ds)):
            assert bytes(ds.read_payload(i)) == bytes(want.read_payload(i))


def _local_keys(local: Path) -> set[str]:
    """The local conversion's files, its payload ranges included (an output in a bucket records them as each shard
    is uploaded: tests/write/test_remote_ranges.py)."""
    return {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}


def _keys(root: Path, prefix: str) -> set[str]:
    base = root / prefix
    return {p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()}


def _etags(root: Path, prefix: str) -> dict[str, tuple[int, int]]:
    """Each object's identity as the emulated store's ETag has it (inode and mtime: a new PUT changes both)."""
    return {k: (os.stat(root / prefix / k).st_ino, os.stat(root / prefix / k).st_mtime_ns)
            for k in _keys(root, prefix)}


# ---------------------------------------------------------------- item 1: every format, the Writer, staging


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_converts_into_a_bucket_as_it_converts_to_a_folder(fmt, source, moto_endpoint, bucket, tmp_path):
    kw = {"to": fmt, "shard_bytes": 6_000, **FORMAT_OPTIONS.get(fmt, {})}
    local = _local(source, tmp_path, **kw)
    url = f"s3://{bucket}/ds.{fmt}"
    result = _convert(source, url, moto_endpoint, tmp_path, **kw)
    assert result.output == url and result.num_samples == 24
    with s3_store(moto_endpoint, url + "/") as store:
        keys = {o.key for o in store.list()}
    assert keys == _local_keys(local)  # no .packer-partial
    assert not [p for p in (tmp_path / "staging").rglob("*") if p.is_file()]  # the staging folder emptied
    _same_as_local(url, moto_endpoint, local, tmp_path / "cache")


def test_the_staging_folder_holds_the_shards_in_flight_not_the_dataset(source, tmp_path):
    (tmp_path / "root").mkdir()
    srv = Emulated(tmp_path / "root", bandwidth=60_000)  # a slow link: the writer waits for its uploads
    staged: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            staged.append(sum(p.stat().st_size for p in (tmp_path / "staging").rglob("shard-*") if p.is_file()
                              and "journal" not in p.parts) if (tmp_path / "staging").exists() else 0)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        _convert(source, "s3://bucket/ds.lmdb", srv.server.endpoint, tmp_path, to="lmdb", shard_bytes=3_000,
                 workers=2)  # worker processes forked after this process used the store: they never touch it
    finally:
        stop.set()
        watcher.join()
        srv.stop()
    manifest = read_manifest(tmp_path / "root" / "ds.lmdb")
    sizes = [sum(f.num_bytes for f in s.files) for s in manifest.shards]
    assert len(sizes) >= 10 and max(staged) > 0
    # at most the shard being written, the one waiting and the one uploading (+1 for a shard between steps)
    assert max(staged) <= 4 * max(sizes) < sum(sizes) / 2


def test_writer_to_a_bucket_reads_back_and_refuses_what_it_cannot_do(source, fresh_store, tmp_path):
    url, options = "s3://bucket/w.lmdb", _options(fresh_store.server.endpoint)
    jpegs = sorted(source.rglob("*.jpg"))
    with packer.Writer(url, format="lmdb", fields={"caption": "str"}, storage_options=options,
                       staging_dir=tmp_path / "staging", shard_bytes=4_000) as w:
        for k, path in enumerate(jpegs):
            w.add(image=path.read_bytes(), label=k % 2, caption=f"photo {k}")
    assert w.close() == url
    with packer.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=options, fields="all") as ds:
        assert len(ds) == len(jpegs) and len(ds.manifest.shards) > 1
        for k, path in enumerate(jpegs):
            assert bytes(ds.read_payload(k)) == path.read_bytes() and ds[k]["caption"] == f"photo {k}"
    with pytest.raises(OutputExistsError, match="^s3://bucket/w.lmdb: already exists"):
        packer.Writer(url, storage_options=options)
    with pytest.raises(OutputExistsError, match="^s3://bucket/w.lmdb: already exists"):  # as for a folder
        packer.Writer(url, resume=True, storage_options=options)
    # a conversion's unfinished upload (its plan names no Writer): not taken over by a Writer's resume, kept
    fresh_store.write(f"c.lmdb/{REMOTE_PARTIAL}/plan.json", json.dumps({"options": {"format": "lmdb"}}).encode())
    with pytest.raises(OutputExistsError, match="^s3://bucket/c.lmdb: not written by a packer Writer .a conversion's., "
                       "so the unfinished upload can't be resumed; write again with overwrite=True"):
        packer.Writer("s3://bucket/c.lmdb", resume=True, storage_options=options, staging_dir=tmp_path / "st")
    assert _keys(tmp_path / "root", "c.lmdb") == {f"{REMOTE_PARTIAL}/plan.json"}


def test_http_outputs_are_refused_in_one_line_and_file_urls_are_folders(source, fresh_store, tmp_path):
    http = f"{fresh_store.server.endpoint}/bucket/x.lmdb"
    with pytest.raises(OptionError, match="^http://.*/bucket/x.lmdb: packer writes datasets to s3://, gs://, az:// "
                       "only"):
        convert(source, http, to="lmdb", progress=False)
    with pytest.raises(OptionError, match="packer writes datasets to s3://, gs://, az:// only"):
        packer.Writer(http)
    assert not _keys(tmp_path / "root", "")
    assert convert(source, f"file://{tmp_path}/f.lmdb", to="lmdb", progress=False).output == tmp_path / "f.lmdb"
    with packer.Writer(f"file://{tmp_path}/w.lmdb") as w:
        w.add(image=next(source.rglob("*.jpg")).read_bytes(), label=0)
    assert w.close() == tmp_path / "w.lmdb" and len(packer.open_dataset(tmp_path / "w.lmdb")) == 1


def test_a_conversion_stopped_by_a_bad_file_leaves_nothing_in_the_bucket(source, fresh_store, tmp_path):
    """``on_error="raise"`` and a file that is not an image: one line naming it, and nothing of the run left under
    the prefix (its plan.json was left before: the prefix then looked like an unfinished upload)."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(source, src)
    (src / "class_1" / "zz-bad.jpg").write_bytes(b"not a jpeg at all")
    with pytest.raises(PackerError, match="zz-bad.jpg"):
        _convert(src, "s3://bucket/bad.lmdb", fresh_store.server.endpoint, tmp_path, to="lmdb", on_error="raise",
                 order="source", shard_bytes=6_000)
    assert not _keys(tmp_path / "root", "bad.lmdb")
    _convert(src, "s3://bucket/bad.lmdb", fresh_store.server.endpoint, tmp_path, to="lmdb")  # nothing in the way


# ---------------------------------------------------------------- the WebDataset export (--to wds)


def _wds_samples(folder: Path) -> dict[str, dict]:
    """Every sample of the export in ``folder`` as the webdataset package gives it, by key."""
    webdataset = pytest.importorskip("webdataset")
    shards = sorted(str(p) for p in folder.glob("shard-*.tar"))
    return {sample["__key__"]: {k: v for k, v in sample.items() if not k.startswith("__")}
            for sample in webdataset.WebDataset(shards, shardshuffle=False)}


def test_a_wds_export_uploads_each_tar_as_it_is_closed_and_its_index_last(source, tmp_path):
    """``convert(src, URL, to="wds")``: the tars are uploaded as each is closed (the staging folder holds one at a
    time, over a slow link), the index last; the objects are the local export's bytes, and read back equal through
    the ``webdataset`` package (from a download) and through packer's own reader (converting the URL back)."""
    root, url = tmp_path / "root", "s3://bucket/imgs-wds"
    root.mkdir()
    local = convert(source, tmp_path / "local-wds", to="wds", shard_bytes=3_000, workers=0, progress=False).output
    srv = Emulated(root, bandwidth=60_000)
    staged: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            staged.append(len(list((tmp_path / "staging").rglob("*.tar"))) if (tmp_path / "staging").exists() else 0)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = _convert(source, url, srv.server.endpoint, tmp_path, to="wds", shard_bytes=3_000)
    finally:
        stop.set()
        watcher.join()
        srv.stop()
    assert result.output == url and result.num_samples == 24 and not result.errors
    tars = sorted(p.name for p in Path(local).glob("shard-*.tar"))
    assert len(tars) >= 10 and max(staged) >= 1
    assert max(staged) <= 2  # the tar being written and the one uploading at most: never the export
    assert _keys(root, "imgs-wds") == {p.name for p in Path(local).iterdir()}  # no .packer-partial left
    for name in [*tars, "classes.txt", "errors.json"]:
        assert (root / "imgs-wds" / name).read_bytes() == (Path(local) / name).read_bytes(), name
    index = json.loads((root / "imgs-wds" / "packer-wds.json").read_text())
    want = json.loads((Path(local) / "packer-wds.json").read_text())
    assert {**index, "created_at": ""} == {**want, "created_at": ""}
    put_at = {k: os.stat(root / "imgs-wds" / k).st_mtime_ns for k in _keys(root, "imgs-wds")}
    assert put_at["packer-wds.json"] >= max(put_at.values())  # the index was put last
    assert not [p for p in (tmp_path / "staging").rglob("*") if p.is_file()]

    srv = Emulated(root)
    try:
        endpoint, download = srv.server.endpoint, tmp_path / "download"
        download.mkdir()
        with s3_store(endpoint, url + "/") as store:
            for key in sorted(o.key for o in store.list()):
                (download / key).write_bytes(store.get(key))
        got = _wds_samples(download)
        assert got == _wds_samples(Path(local)) and len(got) == 24
        back = convert(url, tmp_path / "back.lmdb", workers=0, progress=False, storage_options=_options(endpoint))
    finally:
        srv.stop()
    direct = packer.open_dataset(_local(source, tmp_path))
    ds = packer.open_dataset(back.output)
    def rel(d) -> list[str]:
        return ["/".join(Path(path).parts[-2:]) for path, _ in d.samples]

    assert (ds.classes, ds.targets, rel(ds)) == (direct.classes, direct.targets, rel(direct))
    assert all(bytes(ds.read_payload(i)) == bytes(direct.read_payload(i)) for i in range(len(ds)))


def test_a_wds_export_to_a_bucket_keeps_the_output_rules(source, fresh_store, tmp_path):
    """An export at a URL is replaced only with overwrite (and only a packer one: an export or a dataset); resume
    of a finished one is "already exists" and of an unfinished one refused (an export is not resumed part-way); a
    failed upload (a lasting 500 on a tar) leaves nothing, no index, and says so in one line without credentials."""
    endpoint, root, url = fresh_store.server.endpoint, tmp_path / "root", "s3://bucket/x-wds"
    _convert(source, url, endpoint, tmp_path, to="wds")  # 16 or more tars: one sample each here
    kept = _etags(root, "x-wds")
    for kw in ({}, {"resume": True}):
        with pytest.raises(OutputExistsError, match="^s3://bucket/x-wds: already exists .use overwrite=True"):
            _convert(source, url, endpoint, tmp_path, to="wds", **kw)
    assert _etags(root, "x-wds") == kept
    # replaced by an export of fewer tars: the old tars the new one lacks are deleted
    _convert(source, url, endpoint, tmp_path, to="wds", shard_bytes=20_000, overwrite=True)
    fewer = {p.name for p in Path(convert(source, tmp_path / "l-wds", to="wds", shard_bytes=20_000, workers=0,
                                          progress=False).output).iterdir()}
    assert _keys(root, "x-wds") == fewer and len(fewer) < len(kept)
    # someone's object beside the export: not replaced, nothing deleted
    fresh_store.write("x-wds/notes.txt", b"mine")
    with pytest.raises(OutputExistsError, match="holds 1 object.s. its packer-wds.json does not name .notes.txt."):
        _convert(source, url, endpoint, tmp_path, to="wds", shard_bytes=20_000, overwrite=True)
    (root / "x-wds" / "notes.txt").unlink()
    # a lasting error part-way: one line, nothing kept (an export is not resumed), no index at any time
    fresh_store.faults.add(Fault("status", 500, "InternalError"), key="x-wds/shard-000003.tar", method="PUT",
                           times=-1)
    with pytest.raises(PackerError) as failed:
        _convert(source, url, endpoint, tmp_path, to="wds", shard_bytes=6_000, overwrite=True)
    message = str(failed.value)
    assert message.startswith("s3://bucket/x-wds: uploading shard-000003.tar failed (s3://bucket/x-wds/shard-000003"
                              ".tar: ") and message.endswith("; nothing was kept")
    assert "\n" not in message and SECRET not in message
    assert not _keys(root, "x-wds")
    fresh_store.faults.clear()
    # an unfinished upload (a killed export's lock and plan): resume refused, overwrite replaces it
    fresh_store.write("x-wds/shard-000000.tar", b"half")
    fresh_store.write(f"x-wds/{REMOTE_PARTIAL}/plan.json", b"{}")
    with pytest.raises(OutputExistsError, match="a WebDataset export is not resumed, so the unfinished upload can't "
                       "be resumed; convert again with overwrite=True"):
        _convert(source, url, endpoint, tmp_path, to="wds", resume=True)
    _convert(source, url, endpoint, tmp_path, to="wds", shard_bytes=20_000, overwrite=True)
    assert _keys(root, "x-wds") == fewer


# ---------------------------------------------------------------- --split and --if-changed to a URL


@pytest.mark.filterwarnings("ignore::packer.errors.IndexingWarning")  # each part leaves the other's records out
def test_a_split_to_a_url_writes_the_parts_a_local_split_writes(source, fresh_store, tmp_path):
    endpoint, root = fresh_store.server.endpoint, tmp_path / "root"
    train, val = convert_split(source, "s3://bucket/s.lmdb", split=0.75, seed=3, shard_bytes=6_000,
                                      workers=0, progress=False, storage_options=_options(endpoint),
                                      staging_dir=tmp_path / "staging")
    local = convert_split(source, tmp_path / "s.lmdb", split=0.75, seed=3, shard_bytes=6_000, workers=0,
                                 progress=False)
    assert (train.output, val.output) == ("s3://bucket/s.lmdb-train", "s3://bucket/s.lmdb-val")
    assert (train.num_samples, val.num_samples) == (local[0].num_samples, local[1].num_samples) == (18, 6)
    for part, folder in zip(("train", "val"), (local[0].output, local[1].output), strict=True):
        assert _keys(root, f"s.lmdb-{part}") == _local_keys(Path(folder))
        _same_as_local(f"s3://bucket/s.lmdb-{part}", endpoint, Path(folder), tmp_path / "cache")
    with pytest.raises(OutputExistsError, match="^s3://bucket/s.lmdb-train: already exists"):
        convert_split(source, "s3://bucket/s.lmdb", split=0.75, seed=3, workers=0, progress=False,
                             storage_options=_options(endpoint), staging_dir=tmp_path / "staging")


def test_if_changed_reuses_an_upload_of_the_same_files_and_replaces_a_stale_one_only_with_overwrite(
        source, fresh_store, tmp_path):
    """``--if-changed`` to a URL (refused before): an upload of the same options and source files is reused with
    nothing put or deleted; after a source file changes it is "out of date" (kept) until ``--overwrite``."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(source, src)
    endpoint, root, url = fresh_store.server.endpoint, tmp_path / "root", "s3://bucket/f.lmdb"
    first = _convert(src, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000, if_changed=True)
    assert not first.reused and first.num_samples == 24
    kept, before = _etags(root, "f.lmdb"), fresh_store.server.stats.settled()
    again = _convert(src, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000, if_changed=True)
    after = fresh_store.server.stats.settled()
    assert again.reused and again.num_samples == 24 and again.output == url
    assert (after["puts"], after["deletes"]) == (before["puts"], before["deletes"]) and _etags(root, "f.lmdb") == kept
    with pytest.raises(OutputExistsError, match="^s3://bucket/f.lmdb: out of date .other options: shard_bytes"):
        _convert(src, url, endpoint, tmp_path, to="lmdb", shard_bytes=9_000, if_changed=True)
    changed = sorted(src.rglob("*.jpg"))[0]
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 10**9))
    with pytest.raises(OutputExistsError, match="^s3://bucket/f.lmdb: out of date .the source's files changed"):
        _convert(src, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000, if_changed=True)
    assert _etags(root, "f.lmdb") == kept
    redone = _convert(src, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000, if_changed=True, overwrite=True)
    assert not redone.reused and redone.num_samples == 24
    assert _convert(src, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000, if_changed=True).reused
    _same_as_local(url, endpoint, _local(src, tmp_path, shard_bytes=6_000), tmp_path / "cache")


# ---------------------------------------------------------------- item 2: killed, then --resume


def _aws(endpoint: str) -> dict:
    return {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint}


def _env(endpoint: str) -> dict:
    """A child's environment: the store's credentials and endpoint, as a user exports them."""
    return {**os.environ, "PYTHONPATH": os.getcwd(), **_aws(endpoint)}


def _cli(monkeypatch, endpoint: str, *args) -> subprocess.CompletedProcess:
    """``packer *args`` in this interpreter (support/cli.py) with _env's credentials and endpoint set: for runs that
    are not about the process (a kill, a Ctrl-C)."""
    for name, value in _aws(endpoint).items():
        monkeypatch.setenv(name, value)
    return run_cli(*args)


def test_a_killed_upload_never_opens_and_resume_uploads_only_what_is_missing(source, tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    local = _local(source, tmp_path, shard_bytes=2_500)
    srv = Emulated(root, bandwidth=40_000)
    url, journal = "s3://bucket/ds.lmdb", root / "ds.lmdb" / REMOTE_PARTIAL / "journal"
    args = ["convert", str(source), "--to", "lmdb", "-o", url, "-q", "--workers", "0", "--shard-size", "2500",
            "--staging-dir", str(tmp_path / "staging-1")]
    try:
        killed_upload([sys.executable, "-m", "packer", *args], _env(srv.server.endpoint), journal, srv)
        uploaded = sorted(p.stem for p in journal.glob("shard-*.json"))
        assert not (root / "ds.lmdb" / "manifest.json").exists()
        with pytest.raises(InputNotFoundError, match="no packer dataset there .*an upload that did not finish"):
            packer.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_options(srv.server.endpoint))
        # without --resume the unfinished upload is refused, naming the killed writer and the ways out
        again = _cli(monkeypatch, srv.server.endpoint, *args)
        assert again.returncode != 0 and "an unfinished upload (written by pid" in again.stderr
        assert "--resume" in again.stderr and SECRET not in again.stderr

        before, kept = srv.server.stats.settled(), _etags(root, "ds.lmdb")
        resume = [*args[:-1], str(tmp_path / "staging-2"), "--resume"]  # another staging folder: the bucket's journal
        done = _cli(monkeypatch, srv.server.endpoint, *resume)
        assert done.returncode == 0, done.stderr
        after = srv.server.stats.settled()
    finally:
        srv.stop()
    manifest = read_manifest(root / "ds.lmdb")
    for shard_id in uploaded:  # the shards uploaded before the kill were not put again
        for f in manifest.shards[int(shard_id.split("-")[1])].files:
            assert _etags(root, "ds.lmdb")[f.name] == kept[f.name]
    shard_files = sum(len(s.files) for s in manifest.shards)
    uploaded_files = sum(len(manifest.shards[int(s.split("-")[1])].files) for s in uploaded)
    missing = shard_files - uploaded_files
    journal_puts = len(manifest.shards) - len(uploaded)
    # missing shard files, their journal entries, meta/, errors.json, manifest; the lock taken over (1), no plan
    assert after["puts"] - before["puts"] == missing + journal_puts + len(manifest.meta_files) + 2 + 1
    assert not (root / "ds.lmdb" / REMOTE_PARTIAL).exists()
    srv2 = Emulated(root)
    try:
        _same_as_local(url, srv2.server.endpoint, local, tmp_path / "cache")
    finally:
        srv2.stop()


def test_resume_of_a_finished_upload_says_so_and_does_nothing(source, fresh_store, tmp_path, monkeypatch):
    """``--resume`` pasted after an upload that finished: exit 0 and one line, as for a folder
    (tests/write/test_resume.py), nothing put or deleted in the bucket; it was refused (exit 2) before. A dataset of
    other options or another source is refused, naming the difference."""
    endpoint, root, url = fresh_store.server.endpoint, tmp_path / "root", "s3://bucket/ds.lmdb"
    _convert(source, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000)
    kept = _etags(root, "ds.lmdb")
    args = ["convert", source, "--to", "lmdb", "-o", url, "--shard-size", "6000", "--workers", "0", "--staging-dir",
            tmp_path / "st", "--resume"]
    before = fresh_store.server.stats.settled()
    res = _cli(monkeypatch, endpoint, *args)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout == (f"nothing to resume: {url} is complete (the same options, the same source files, sizes and "
                          "times); nothing was done\n")
    after = fresh_store.server.stats.closed()
    assert (after["puts"], after["deletes"], after["parts"]) == (before["puts"], before["deletes"], before["parts"])
    assert _etags(root, "ds.lmdb") == kept
    result = _convert(source, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000, resume=True)
    assert result.nothing_to_resume and not result.reused and result.num_samples == 24 and result.output == url
    other = _cli(monkeypatch, endpoint, *args, "--validate", "header")
    assert other.returncode == 2 and len(other.stderr.splitlines()) == 1, other.stderr
    assert other.stderr.startswith(f"packer: error: {url}: a complete dataset, so there is nothing to resume, and it "
                                   "is not this conversion's (other options: validate full -> header)")
    assert "--overwrite" in other.stderr and SECRET not in other.stderr
    (root / "ds.lmdb" / "shard-00001.lmdb").write_bytes(b"cut")  # damaged in the bucket: not taken as finished
    damaged = _cli(monkeypatch, endpoint, *args)
    assert damaged.returncode == 2 and "it does not open: s3://bucket/ds.lmdb/shard-00001.lmdb: 3 bytes" in \
        damaged.stderr
    assert _etags(root, "ds.lmdb").keys() == kept.keys()


def test_a_huge_or_damaged_errors_json_at_the_output_is_one_line_naming_its_url(source, fresh_store, tmp_path,
                                                                                 monkeypatch):
    """``--resume`` and ``--if-changed`` read a finished upload's manifest and errors.json; an object there larger
    than any such file (someone's, or damage) is refused by its listed size, never read into memory."""
    endpoint, root, url = fresh_store.server.endpoint, tmp_path / "root", "s3://bucket/ds.lmdb"
    _convert(source, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000)
    with open(root / "ds.lmdb" / "errors.json", "r+b") as f:  # sparse: 300 MB listed, nothing on disk
        f.truncate(300 << 20)
    args = ["convert", source, "--to", "lmdb", "-o", url, "--shard-size", "6000", "--workers", "0", "--staging-dir",
            tmp_path / "st"]
    before = fresh_store.server.stats.settled()
    for flag in ("--resume", "--if-changed"):
        res = _cli(monkeypatch, endpoint, *args, flag)
        assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
        assert f"{url}/errors.json: implausibly large (314572800 bytes" in res.stderr
    after = fresh_store.server.stats.closed()
    assert after["body_bytes"] - before["body_bytes"] < 1 << 20  # the manifest at most, not the 300 MB
    (root / "ds.lmdb" / "errors.json").write_bytes(b'{"errors": [')  # damaged: named by its URL, not a local copy
    res = _cli(monkeypatch, endpoint, *args, "--if-changed")
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"packer: error: {url}/errors.json: damaged error report") and "packer-finished-" \
        not in res.stderr


WRITER = """
import sys
sys.path.insert(0, sys.argv[3])
from support.fielded import write_fielded
write_fielded(sys.argv[1], "lmdb", count=int(sys.argv[4]), shard_bytes=2000, staging_dir=sys.argv[2])
"""


def test_a_killed_writer_resumes_uploading_only_what_is_missing(tmp_path):
    """``Writer(URL, resume=True)`` after a SIGKILL of the writing process, from another staging folder (another
    machine's): the shards journaled in the bucket (their field spools beside their entries) are not put again,
    and the dataset reads back equal to an uninterrupted Writer's, fields included. It was refused before."""
    count, root, url = 40, tmp_path / "root", "s3://bucket/w.lmdb"
    root.mkdir()
    samples = write_fielded(tmp_path / "whole.lmdb", "lmdb", count=count, shard_bytes=2000)
    whole = packer.open_dataset(tmp_path / "whole.lmdb", fields="all")
    tests = str(Path(__file__).resolve().parents[1])
    srv = Emulated(root, bandwidth=40_000)
    journal = root / "w.lmdb" / REMOTE_PARTIAL / "journal"
    endpoint = srv.server.endpoint
    env = {**_env(endpoint), "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), tests])}
    try:
        killed_upload([sys.executable, "-c", WRITER, url, str(tmp_path / "staging-1"), tests, str(count)], env,
                      journal, srv, shards=2)
        uploaded = sorted(int(p.stem.split("-")[1]) for p in journal.glob("shard-*.json"))
        spooled = {len([p for p in (journal / f"shard-{i:05d}.fields").rglob("*") if p.is_file()]) for i in uploaded}
        assert not (root / "w.lmdb" / "manifest.json").exists() and len(spooled) == 1 and spooled != {0}
        kept = _etags(root, "w.lmdb")
        with pytest.raises(OutputExistsError, match="an unfinished upload .written by pid .*resume=True"):
            write_fielded(url, "lmdb", count=count, shard_bytes=2000, storage_options=_options(endpoint),
                          staging_dir=tmp_path / "staging-2")
        with pytest.raises(OutputExistsError, match="written with other options, fields or classes, so the "
                           "unfinished upload can't be resumed; write again with overwrite=True"):
            write_fielded(url, "lmdb", count=count, shard_bytes=3000, resume=True, storage_options=_options(endpoint),
                          staging_dir=tmp_path / "staging-2")
        before = srv.server.stats.settled()
        write_fielded(url, "lmdb", count=count, shard_bytes=2000, resume=True, storage_options=_options(endpoint),
                      staging_dir=tmp_path / "staging-2")
        after = srv.server.stats.settled()
    finally:
        srv.stop()
    manifest = read_manifest(root / "w.lmdb")
    assert _files(manifest) == _files(whole.manifest) and len(manifest.shards) == len(whole.manifest.shards) > 8
    assert 2 <= len(uploaded) < len(manifest.shards)
    etags = _etags(root, "w.lmdb")
    for i in uploaded:  # the shards uploaded before the kill were not put again
        for f in manifest.shards[i].files:
            assert etags[f.name] == kept[f.name]
    missing = [i for i in range(len(manifest.shards)) if i not in uploaded]
    # each missing shard's files, field spool and journal entry; meta/, errors.json, manifest; the lock taken over
    per_shard = spooled.pop()
    assert after["puts"] - before["puts"] == (sum(len(manifest.shards[i].files) for i in missing)
                                             + len(missing) * (per_shard + 1) + len(manifest.meta_files) + 2 + 1)
    assert not (root / "w.lmdb" / REMOTE_PARTIAL).exists()
    srv2 = Emulated(root)
    try:
        with packer.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_options(srv2.server.endpoint),
                                 fields="all") as ds:
            assert (ds.classes, ds.targets, len(ds)) == (whole.classes, whole.targets, count)
            for i, want in enumerate(samples):
                assert bytes(ds.read_payload(i)) == bytes(whole.read_payload(i)) == want["image"]
                got = ds[i]
                assert all(same_value(got[name], want[name]) for name in SPECS), i
    finally:
        srv2.stop()


# ---------------------------------------------------------------- item 3: --overwrite, a second writer


def test_an_existing_dataset_is_refused_without_overwrite_and_replaced_with_it(source, fresh_store, tmp_path):
    endpoint, root, url = fresh_store.server.endpoint, tmp_path / "root", "s3://bucket/ds.lmdb"
    _convert(source, url, endpoint, tmp_path, to="lmdb", shard_bytes=2_500)
    old = _keys(root, "ds.lmdb")
    with pytest.raises(OutputExistsError, match="^s3://bucket/ds.lmdb: already exists"):
        _convert(source, url, endpoint, tmp_path, to="lmdb")
    assert _keys(root, "ds.lmdb") == old
    # an --overwrite that fails part-way: the old manifest went first, so neither dataset (nor a mix) opens
    fresh_store.faults.add(Fault("status", 500, "InternalError"), key="ds.lmdb/shard-00001.lmdb", method="PUT",
                           times=-1)
    with pytest.raises(PackerError, match="^s3://bucket/ds.lmdb: uploading shard-00001.lmdb failed "
                       r"\(s3://bucket/ds.lmdb/shard-00001.lmdb: .*500") as failed:
        _convert(source, url, endpoint, tmp_path, to="lmdb", shard_bytes=2_500, overwrite=True)
    assert SECRET not in str(failed.value) and "resume=True" in str(failed.value)
    assert "manifest.json" not in _keys(root, "ds.lmdb") and "shard-00005.lmdb" in _keys(root, "ds.lmdb")
    with pytest.raises(InputNotFoundError, match="no packer dataset there"):
        packer.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_options(endpoint))
    fresh_store.faults.clear()
    # replaced by a dataset of fewer shards: the old dataset's objects the new one lacks are deleted
    local = _local(source, tmp_path, shard_bytes=6_000)
    _convert(source, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000, overwrite=True)
    assert _keys(root, "ds.lmdb") == _local_keys(local)
    assert len(old) > len(_keys(root, "ds.lmdb"))
    _same_as_local(url, endpoint, local, tmp_path / "cache")


def test_a_prefix_of_other_objects_is_refused_even_with_overwrite_and_kept(source, fresh_store, tmp_path):
    fresh_store.write("mine/notes.txt", b"not packer's")
    fresh_store.write("mine/shard-00000.lmdb", b"not packer's either")
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError, match="not a packer dataset"):
            _convert(source, "s3://bucket/mine", fresh_store.server.endpoint, tmp_path, to="lmdb", overwrite=overwrite)
    assert _keys(tmp_path / "root", "mine") == {"notes.txt", "shard-00000.lmdb"}
    assert (tmp_path / "root" / "mine" / "notes.txt").read_bytes() == b"not packer's"
    # a dataset with someone's object added under its prefix: not replaced, nothing of it deleted
    _convert(source, "s3://bucket/ds.lmdb", fresh_store.server.endpoint, tmp_path, to="lmdb")
    fresh_store.write("ds.lmdb/README.txt", b"mine")
    kept = _etags(tmp_path / "root", "ds.lmdb")
    with pytest.raises(OutputExistsError, match="holds 1 object.s. its manifest.json does not name .README.txt."):
        _convert(source, "s3://bucket/ds.lmdb", fresh_store.server.endpoint, tmp_path, to="lmdb", overwrite=True)
    assert _etags(tmp_path / "root", "ds.lmdb") == kept


def test_a_second_writer_is_refused_by_the_lock(source, fresh_store, tmp_path):
    options = _options(fresh_store.server.endpoint)
    first = RemoteOutput("s3://bucket/ds.lmdb", options, tmp_path / "a", policy=FAST_POLICY)
    second = RemoteOutput("s3://bucket/ds.lmdb", options, tmp_path / "b", policy=FAST_POLICY)
    first.check(source, True)
    second.check(source, True)  # both found the prefix empty: the lock (a create-only put) decides
    lock = first.start({"plan": 1})
    try:
        with pytest.raises(OutputExistsError, match="another conversion began writing here meanwhile"):
            second.start({"plan": 2})
        assert json.loads((tmp_path / "root" / "ds.lmdb" / REMOTE_LOCK).read_text())["pid"] == os.getpid()
        # a writer alive on this machine holds it: even --overwrite and --resume are refused
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            fresh_store.write(f"ds.lmdb/{REMOTE_LOCK}", json.dumps({"host": os.uname().nodename, "pid": sleeper.pid,
                                                                "since": "now"}).encode())
            for kw in ({"overwrite": True}, {"resume": True}):
                with pytest.raises(PackerError, match=f"in use by a conversion running as pid {sleeper.pid}"):
                    _convert(source, "s3://bucket/ds.lmdb", fresh_store.server.endpoint, tmp_path, to="lmdb", **kw)
        finally:
            sleeper.kill()
            sleeper.wait()
    finally:
        lock.release()


def test_against_moto_too_two_writers_racing_for_the_lock_leave_one(source, moto_endpoint, bucket, tmp_path):
    url, options = f"s3://{bucket}/ds.lmdb", _options(moto_endpoint)
    first = RemoteOutput(url, options, tmp_path / "a", policy=FAST_POLICY)
    second = RemoteOutput(url, options, tmp_path / "b", policy=FAST_POLICY)
    first.check(source, True)
    second.check(source, True)
    lock = first.start({"plan": 1})
    try:
        with pytest.raises(OutputExistsError, match="another conversion began writing here meanwhile"):
            second.start({"plan": 2})
        with s3_store(moto_endpoint, url + "/") as store:
            assert json.loads(store.get(REMOTE_LOCK))["token"] == first._token
    finally:
        lock.release()


def test_a_writer_whose_upload_was_taken_over_puts_nothing_more(source, fresh_store, tmp_path):
    """``overwrite`` of an unfinished upload whose writer runs elsewhere (unseen: another machine) takes its lock;
    the first writer stops at its next shard and never puts a manifest: the dataset is the second writer's."""
    url, options = "s3://bucket/w.lmdb", _options(fresh_store.server.endpoint)
    jpegs = sorted(source.rglob("*.jpg"))
    first = packer.Writer(url, storage_options=options, staging_dir=tmp_path / "a", shard_bytes=2_000)
    for k, path in enumerate(jpegs[:10]):
        first.add(image=path.read_bytes(), label=k % 2)
    with packer.Writer(url, storage_options=options, staging_dir=tmp_path / "b", overwrite=True) as second:
        for k, path in enumerate(jpegs):
            second.add(image=path.read_bytes(), label=k % 2)
    kept = _etags(tmp_path / "root", "w.lmdb")
    with pytest.raises(PackerError, match="another conversion took this upload over meanwhile .its lock is gone."):
        for k, path in enumerate(jpegs[10:]):
            first.add(image=path.read_bytes(), label=k % 2)
        first.close()
    assert _etags(tmp_path / "root", "w.lmdb") == kept
    with packer.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=options) as ds:
        assert [bytes(ds.read_payload(i)) for i in range(len(ds))] == [p.read_bytes() for p in jpegs]


# ---------------------------------------------------------------- item 4: faults, credentials, Ctrl-C


def test_503s_are_retried_and_a_lasting_error_is_one_line_without_credentials(source, fresh_store, tmp_path):
    endpoint, root, url = fresh_store.server.endpoint, tmp_path / "root", "s3://bucket/ds.lmdb"
    local = _local(source, tmp_path, shard_bytes=6_000)
    fresh_store.faults.add(Fault("status", 503, "SlowDown"), key="ds.lmdb/shard-00001.lmdb", method="PUT", times=2)
    fresh_store.faults.add(Fault("status", 503, "SlowDown"), key="ds.lmdb/manifest.json", method="PUT", times=1)
    _convert(source, url, endpoint, tmp_path, to="lmdb", shard_bytes=6_000)
    assert fresh_store.faults.applied == [("status", "PUT", "ds.lmdb/shard-00001.lmdb")] * 2 + [
        ("status", "PUT", "ds.lmdb/manifest.json")]
    _same_as_local(url, endpoint, local, tmp_path / "cache")
    for path in root.rglob("*"):  # the manifest, errors.json, everything put: no credential
        assert not path.is_file() or SECRET.encode() not in path.read_bytes()
    fresh_store.faults.clear()
    fresh_store.faults.add(Fault("status", 503, "SlowDown"), key="other.lmdb/shard-00000.lmdb", method="PUT", times=-1)
    with pytest.raises(PackerError) as failed:
        _convert(source, "s3://bucket/other.lmdb", endpoint, tmp_path, to="lmdb")
    message = str(failed.value)
    assert "\n" not in message and SECRET not in message and message.startswith(
        "s3://bucket/other.lmdb: uploading shard-00000.lmdb failed (s3://bucket/other.lmdb/shard-00000.lmdb: ")
    assert "503" in message and len(fresh_store.faults.applied) > 2  # retried, then given up
    assert message.endswith("kept in s3://bucket/other.lmdb (an unfinished upload: its journal under .packer-partial/):"
                            " fix the problem (the link, the credentials, the bucket's quota; or free local space for "
                            "staging), then run the same command with resume=True")
    assert "manifest.json" not in _keys(root, "other.lmdb")
    for path in (root / "other.lmdb" / REMOTE_PARTIAL).rglob("*"):  # the lock, plan and journal kept for --resume
        assert not path.is_file() or SECRET.encode() not in path.read_bytes()


def test_ctrl_c_leaves_no_manifest_and_resume_finishes_the_upload(source, fresh_store, tmp_path, monkeypatch):
    root, url = tmp_path / "root", "s3://bucket/ds.lmdb"
    argv = ["convert", source, "--to", "lmdb", "-o", url, "--workers", "0", "-q", "--shard-size", "6000",
            "--staging-dir", tmp_path / "st"]
    env = _env(fresh_store.server.endpoint)
    stopped = run_cli_at(argv, env, "open", "errors.json", "int")  # a Ctrl-C as the end's files are written
    assert stopped.returncode == 130, stopped.stderr
    assert stopped.stderr.strip().endswith(f"interrupted; the work done so far is kept in {url} (an unfinished "
                                           f"upload: its journal under {REMOTE_PARTIAL}/): run the same command with "
                                           "--resume to go on, or remove it")
    assert "manifest.json" not in _keys(root, "ds.lmdb") and "shard-00000.lmdb" in _keys(root, "ds.lmdb")
    with pytest.raises(InputNotFoundError, match="no packer dataset there"):
        packer.open_dataset(url, cache_dir=tmp_path / "cache", storage_options=_options(fresh_store.server.endpoint))
    other = _cli(monkeypatch, fresh_store.server.endpoint, *argv, "--resume", "--shard-size", "3000")
    assert other.returncode == 2 and other.stderr.strip() == (
        f"packer: error: {url}: the source files or the options changed since the interrupted run, so the unfinished "
        "upload can't be resumed; convert again with --overwrite (it replaces the unfinished upload)")
    done = _cli(monkeypatch, fresh_store.server.endpoint, *argv, "--resume")
    assert done.returncode == 0, done.stderr
    _same_as_local(url, fresh_store.server.endpoint, _local(source, tmp_path, shard_bytes=6_000), tmp_path / "cache")
