"""A dataset at a URL (packer/layout/remote.py) against real servers: moto's S3 for correctness, the emulated store
for counting requests and injecting faults. Metadata fetched once per node and checked as a local dataset's, every
object's ETag recorded at open and required after, forked and spawned readers through the node's downloader,
the cache limit, faults, damage, and credentials kept out of everything shown."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys

import numpy as np
import pytest
from support.storage_servers import CREDENTIALS, FAST_POLICY, Emulated, gone, s3_store, upload, wait_until

from packer.errors import DatasetError, InputNotFoundError, PackerError
from packer.formats import get_format
from packer.layout.index import Index
from packer.layout.manifest import read_manifest
from packer.layout.remote import DatasetReplaced, RemoteDataset
from packer.storage.cache import ChecksumMismatch
from packer.storage.emulate import Fault
from packer.storage.faults import AccessDenied, StorageError
from packer.write.convert import convert

URL = "s3://bucket/ds.lmdb"


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from support.imagesets import make_imagefolder

    base = tmp_path_factory.mktemp("remote")
    out = base / "ds.lmdb"
    convert(make_imagefolder(base / "imgs", classes=3, per_class=4), out, to="lmdb", progress=False)
    return out


@pytest.fixture
def served(tmp_path, packed):
    """The emulated store serving a copy of ``packed`` as s3://bucket/ds.lmdb."""
    root = tmp_path / "root"
    shutil.copytree(packed, root / "ds.lmdb")
    server = Emulated(root)
    yield server
    server.stop()


def _open(server, tmp_path, url: str = URL, **kw) -> RemoteDataset:
    options = {**CREDENTIALS, "endpoint": server.server.endpoint}
    return RemoteDataset(url, tmp_path / "cache", kw.pop("cache_limit", "64MB"), options, FAST_POLICY, linger=0.2,
                         **kw)


def _counts(server) -> dict:
    return server.server.stats.settled()


def test_the_metadata_is_checked_as_a_local_datasets_and_fetched_once_per_node(served, packed, tmp_path):
    local = read_manifest(packed)
    with _open(served, tmp_path) as ds:
        assert ds.manifest.to_dict() == local.to_dict()
        index = Index.load(packed, local.num_samples, files=local.meta_files, num_classes=len(local.classes),
                           source_records=local.source_records)
        assert ds.index is not None
        for name in ("labels", "heights", "widths", "nbytes", "path_blob", "path_offsets", "position"):
            assert np.array_equal(getattr(ds.index, name), getattr(index, name))
        first = _counts(served)
        assert (first["heads"], first["lists"], first["gets"]) == (1, 1, len(local.meta_files) + 2)  # + errors.json
        with _open(served, tmp_path) as again:  # another process of the node opening it: revalidated, not fetched
            assert again.folder == ds.folder and again.manifest.to_dict() == local.to_dict()
        second = _counts(served)
        assert (second["heads"], second["lists"], second["gets"]) == (2, 2, first["gets"])


def test_a_new_manifest_is_a_new_version(served, tmp_path, packed):
    with _open(served, tmp_path) as old:
        pass
    reconverted = tmp_path / "again.lmdb"
    from support.imagesets import make_imagefolder

    convert(make_imagefolder(tmp_path / "imgs2", classes=2, per_class=3), reconverted, to="lmdb", progress=False)
    shutil.rmtree(served.root / "ds.lmdb")
    shutil.copytree(reconverted, served.root / "ds.lmdb")
    with _open(served, tmp_path) as new:
        assert new.version != old.version and new.folder != old.folder
        assert new.manifest.num_samples == 6 and old.manifest.num_samples == 12


def test_shards_and_ranges_read_back_byte_for_byte_from_moto(moto_endpoint, bucket, packed, tmp_path):
    url = f"s3://{bucket}/ds.lmdb"
    with s3_store(moto_endpoint, url) as store:
        upload(store, packed)
    options = {**CREDENTIALS, "endpoint": moto_endpoint}
    with RemoteDataset(url, tmp_path / "cache", "64MB", options, FAST_POLICY, linger=0.2) as ds:
        assert ds.manifest.to_dict() == read_manifest(packed).to_dict()
        root = ds.fetch_shard(0).result(60)
        for f in ds.manifest.shards[0].files:
            assert (root / f.name).read_bytes() == (packed / f.name).read_bytes()
        name = ds.manifest.shards[0].files[0].name
        assert ds.read_range(name, 4096, 9000) == (packed / name).read_bytes()[4096:9000]
        reader = get_format(ds.manifest.format).Reader  # the format's own reader opens the fetched shard
        shard = ds.manifest.shards[0]
        fetched, local = reader(root, shard, ds.manifest.payload), reader(packed, shard, ds.manifest.payload)
        try:
            assert [bytes(fetched.read(i)) for i in range(shard.num_samples)] == \
                [bytes(local.read(i)) for i in range(shard.num_samples)]
        finally:
            fetched.close()
            local.close()


def test_a_dataset_replaced_while_being_read_is_reported_never_mixed(served, tmp_path):
    with _open(served, tmp_path) as ds:
        name = ds.manifest.shards[0].files[0].name
        assert ds.read_range(name, 0, 100) == (served.root / "ds.lmdb" / name).read_bytes()[:100]
        served.write(f"ds.lmdb/{name}", (served.root / "ds.lmdb" / name).read_bytes()[::-1])  # a new ETag
        with pytest.raises(DatasetReplaced, match=r"s3://bucket/ds.lmdb: the dataset was replaced while being read "
                           r"\(.*\): restart the job"):
            ds.fetch_ranges(name, [(100, 200, [])])[0].result(60)
        with pytest.raises(DatasetReplaced, match="restart the job"):
            ds.fetch_shard(0).result(60)
        assert not (ds.shard_root / name).exists()  # nothing of the new version kept
        # the shard's other file was cancelled with it: its temporary file goes as the downloader drops it
        wait_until(lambda: not [p for p in ds.shard_root.rglob("*") if ".tmp-" in p.name], "no temporary left")


def test_404_and_403_at_open_are_one_clear_error_naming_the_url(served, tmp_path):
    with pytest.raises(InputNotFoundError, match=r"^s3://bucket/nothing.lmdb: no packer dataset there"):
        _open(served, tmp_path, "s3://bucket/nothing.lmdb")
    served.faults.add(Fault("status", 403, "AccessDenied"), method="*", times=-1)
    with pytest.raises(AccessDenied, match=r"^s3://bucket/ds.lmdb/manifest.json: access denied") as err:
        _open(served, tmp_path)
    assert "\n" not in str(err.value)


def test_credentials_never_appear_in_a_message_a_repr_or_a_file(served, tmp_path):
    secret = "SECRET-DO-NOT-SHOW-42"
    options = {"aws_access_key_id": "id", "aws_secret_access_key": secret, "region": "us-east-1",
               "endpoint": served.server.endpoint}
    shown = []
    with RemoteDataset(URL, tmp_path / "cache", "64MB", options, FAST_POLICY, linger=0.2) as ds:
        shown += [repr(ds), repr(ds.spec), repr(ds.client), str(ds.location), ds.where("x")]
        ds.fetch_shard(0).result(60)
    served.faults.add(Fault("status", 403, "AccessDenied"), method="*", times=-1)
    with pytest.raises(AccessDenied) as err:
        RemoteDataset(URL, tmp_path / "cache", "64MB", options, FAST_POLICY, linger=0.2)
    shown += [str(err.value), repr(err.value)]
    served.faults.clear()
    for url in (f"http://user:{secret}@{served.server.endpoint[7:]}/bucket/ds.lmdb",
                f"{served.server.endpoint}/bucket/ds.lmdb?X-Amz-Signature={secret}"):
        with pytest.raises(PackerError) as err:
            RemoteDataset(url, tmp_path / "cache", "64MB", None, FAST_POLICY, linger=0.2)
        shown += [str(err.value), repr(err.value)]
    assert not any(secret in text for text in shown), shown
    for path in (tmp_path / "cache").rglob("*"):
        assert secret not in str(path)
        if path.is_file() and not path.is_socket():
            assert secret.encode() not in path.read_bytes(), path


def _read_in_child(ds: RemoteDataset, name: str, digest: str, out) -> None:
    try:
        data = ds.read_range(name, 0, 5000)
        root = ds.fetch_shard(0).result(60)
        same = (root / name).read_bytes()[:5000] == data
        out.put((hashlib.sha256(data).hexdigest() == digest and same, ds.client.server_pid,
                 "obstore" in sys.modules))
    except BaseException as exc:
        out.put((repr(exc), 0, None))
    finally:
        ds.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_readers_forked_or_spawned_after_the_open_fetch_through_the_nodes_downloader(served, tmp_path, method):
    ds = _open(served, tmp_path)
    name = ds.manifest.shards[0].files[0].name
    ds.read_range(name, 0, 100)  # the parent has used its connection, as a dataset opened before DataLoader
    digest = hashlib.sha256((served.root / "ds.lmdb" / name).read_bytes()[:5000]).hexdigest()
    ctx = mp.get_context(method)
    out = ctx.Queue()
    procs = [ctx.Process(target=_read_in_child, args=(ds, name, digest, out)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    assert all(r[0] is True for r in results), results
    assert {r[1] for r in results} == {ds.client.server_pid}  # the parent's downloader, not one each
    if method == "spawn":
        assert not any(r[2] for r in results)  # obstore never loaded in a reader
    metadata = sum(f.size for n, f in ds.objects.items() if n.startswith("meta/") or n.endswith(".json"))
    shard = sum(f.num_bytes for f in ds.manifest.shards[0].files)
    assert _counts(served)["body_bytes"] == metadata + 100 + 5000 + shard  # each byte served once for three
    pid = ds.client.server_pid
    ds.close()
    wait_until(lambda: gone(pid), "the downloader exits with its last client")


def test_a_cache_as_large_as_the_dataset_makes_a_second_pass_fetch_nothing(served, tmp_path):
    with _open(served, tmp_path) as ds:
        name = ds.manifest.shards[0].files[0].name
        ds.fetch_shard(0).result(60)
        ds.read_range(name, 0, 1000)
    first = _counts(served)
    with _open(served, tmp_path) as ds:  # the next epoch, or the next job on the node
        ds.fetch_shard(0).result(60)
        ds.read_range(name, 0, 1000)
        assert ds.client.stats()["file_hits"] >= 2
    second = _counts(served)
    assert second["gets"] == first["gets"] and second["body_bytes"] == first["body_bytes"]


def test_a_cache_smaller_than_one_shard_says_so(served, tmp_path):
    with _open(served, tmp_path, cache_limit=4096) as ds:
        with pytest.raises(PackerError, match="raise cache_limit"):
            ds.fetch_shard(0).result(60)


def test_server_faults_are_retried_then_one_error_naming_the_object(served, tmp_path):
    with _open(served, tmp_path) as ds:
        name = ds.manifest.shards[0].files[0].name
        served.faults.add(Fault("status", 503, "SlowDown"), key=f"ds.lmdb/{name}", times=2)
        served.faults.add(Fault("cut", after=100), key=f"ds.lmdb/{name}", times=1)
        root = ds.fetch_shard(0).result(60)
        assert (root / name).read_bytes() == (served.root / "ds.lmdb" / name).read_bytes()
        assert [kind for kind, _, _ in served.faults.applied] == ["status", "status", "cut"]
        served.faults.add(Fault("status", 500, "InternalError"), key=f"ds.lmdb/{name}", times=-1)
        with pytest.raises(StorageError, match=f"s3://bucket/ds.lmdb/{name}: .*500"):
            ds.read_range(name, 0, 100)


def _damage(path, at: int = 200) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_objects_are_never_used(served, tmp_path):
    _damage(served.root / "ds.lmdb/meta/labels.npy", at=-1)
    with pytest.raises(ChecksumMismatch, match="s3://bucket/ds.lmdb/meta/labels.npy: sha256"):
        _open(served, tmp_path)
    _damage(served.root / "ds.lmdb/meta/labels.npy", at=-1)  # mended
    with _open(served, tmp_path) as ds:
        name = ds.manifest.shards[0].files[0].name
    _damage(served.root / "ds.lmdb" / name)
    with _open(served, tmp_path) as ds:
        with pytest.raises(ChecksumMismatch, match=f"s3://bucket/ds.lmdb/{name}: sha256"):
            ds.fetch_shard(0).result(60)
        assert ds.verify_files() == [f"s3://bucket/ds.lmdb/{name}: checksum mismatch (damaged or modified)"]
    (served.root / "ds.lmdb" / name).write_bytes(b"short")
    with pytest.raises(DatasetError, match=f"s3://bucket/ds.lmdb/{name}: 5 bytes, manifest says"):
        _open(served, tmp_path)
    with _open(served, tmp_path, strict=False) as ds:
        assert len(ds.problems) == 1 and ds.index is not None


def test_a_manifest_listing_more_files_than_the_bucket_holds_is_refused_by_counting(served, tmp_path):
    path = served.root / "ds.lmdb/manifest.json"
    manifest = json.loads(path.read_text())
    template = manifest["shards"][0]
    manifest["shards"] += [{**template, "num_samples": 0, "files": [{**template["files"][0], "name": f"x{i}.lmdb"}]}
                           for i in range(1000)]
    served.write("ds.lmdb/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(PackerError, match=r"s3://bucket/ds.lmdb/manifest.json: lists 1,0\d\d files in 1,001 shards, "
                       "but the dataset folder holds"):
        _open(served, tmp_path)


def test_over_plain_http_every_object_gets_a_head_instead_of_a_listing(served, tmp_path, packed):
    url = f"{served.server.endpoint}/bucket/ds.lmdb"
    with RemoteDataset(url, tmp_path / "cache", "64MB", None, FAST_POLICY, linger=0.2) as ds:
        assert ds.manifest.to_dict() == read_manifest(packed).to_dict()
        counts = _counts(served)
        assert counts["lists"] == 0 and counts["heads"] == 1 + len(ds.manifest.all_files()) + 1  # + errors.json
        name = ds.manifest.shards[0].files[0].name
        assert ds.read_range(name, 10, 20) == (packed / name).read_bytes()[10:20]


def test_a_local_path_is_not_a_remote_dataset(tmp_path, packed):
    for local in (str(packed), f"file://{packed}"):
        with pytest.raises(PackerError, match="a local path, not object storage"):
            RemoteDataset(local, tmp_path / "cache")
    assert os.listdir(tmp_path) == []


def test_a_failed_open_leaves_no_connection_behind(served, tmp_path):
    import threading

    before = set(threading.enumerate())
    with pytest.raises(InputNotFoundError):
        _open(served, tmp_path, "s3://bucket/nothing.lmdb")
    assert [t.name for t in set(threading.enumerate()) - before if t.name == "packer-downloader-client"] == []


def test_verify_beside_a_training_job_evicts_little(tmp_path, packed):
    """verify_files hashes its objects a few at a time: their temporary files, counted against the limit, never
    push out what a job on the node has cached when the limit holds the job's entries and two objects."""
    from support.imagesets import make_imagefolder

    root = tmp_path / "root"
    convert(make_imagefolder(tmp_path / "imgs", classes=3, per_class=8), root / "many.lmdb", to="lmdb",
            shard_bytes=6_000, progress=False)
    server = Emulated(root)
    try:
        url = "s3://bucket/many.lmdb"
        with _open(server, tmp_path, url, cache_limit=10 << 20) as probe:
            biggest = max(f.num_bytes for f in probe.manifest.all_files())
            total = sum(f.num_bytes for f in probe.manifest.all_files())
        limit = 2 * biggest + 3000  # the job's range and two objects being hashed
        assert total > limit + biggest  # all at once would need far more than the limit
        with _open(server, tmp_path, url, cache_limit=limit) as job, _open(server, tmp_path, url, cache_limit=None) \
                as checker:
            name = job.manifest.shards[0].files[0].name
            job.read_range(name, 0, 1000)  # the job's cached range
            entry = job.client.path(job.range_entry(name, 0, 1000))
            job.need([job.range_entry(name, 0, 1000)], 1)
            assert checker.verify_files() == []
            assert entry.exists() and job.client.stats()["usage"] <= limit
    finally:
        server.stop()


def test_a_dataset_never_closed_lets_the_downloader_go_once_collected(served, tmp_path):
    """Datasets are often left for the garbage collector: once one is, its connection ends and the node's
    downloader exits with its last client, not with the process."""
    import gc

    ds = _open(served, tmp_path)
    ds.read_range(ds.manifest.shards[0].files[0].name, 0, 100)
    pid = ds.client.server_pid
    del ds
    gc.collect()
    wait_until(lambda: gone(pid), "the downloader exits once the dataset is collected")


def test_a_cache_dir_on_a_network_filesystem_is_warned_about(served, tmp_path, monkeypatch):
    """A node-local cache_dir opens silently; one the mount table puts on NFS warns (SharedCacheWarning) naming the
    folder and the filesystem. The NFS mount is this process's mount table with one line added (no server here)."""
    import warnings

    from packer import sysinfo
    from packer.errors import SharedCacheWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedCacheWarning)
        _open(served, tmp_path).close()
    nfs = tmp_path / "home"
    real_text = sysinfo.proc_text

    def with_nfs(name: str) -> str | None:
        text = real_text(name)
        if name != "self/mountinfo" or text is None:
            return text
        return text + f"999 1 0:99 / {os.path.realpath(nfs)} rw - nfs4 server:/export rw,vers=4.2\n"

    monkeypatch.setattr(sysinfo, "proc_text", with_nfs)
    with pytest.warns(SharedCacheWarning, match=r"cache_dir .*home/c.* is on a network filesystem \(nfs4"):
        RemoteDataset(URL, nfs / "c", "64MB", {**CREDENTIALS, "endpoint": served.server.endpoint}, FAST_POLICY,
                      linger=0.2).close()
