"""open_dataset(URL): a dataset in object storage read as the local one is (packer/read/remote.py), against real
servers: moto's S3 for correctness, the emulated store for counting GETs and bytes and for injecting faults.
Whole-shard mode (remote_mode="shard"; ranged mode: test_ranged_read.py): every format, DataLoader workers (fork),
ThreadLoader, read-ahead along the sampler's order, the cache limit, faults in every reader, and two "nodes" of two
ranks each; in both modes, the pickle a spawned worker gets (the same size for 4 shards and 300)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from support.imagesets import make_imagefolder
from support.spawned import Fetch, batches_of, probe_for
from support.storage_servers import (
    CREDENTIALS,
    Emulated,
    open_served,
    read_all,
    s3_store,
    serve_copy,
    upload,
    wait_until,
)
from torch.utils.data import DataLoader

import packer
from packer import PackerError, ThreadLoader, open_dataset
from packer.errors import InputNotFoundError
from packer.formats import FORMATS
from packer.layout.manifest import read_manifest
from packer.layout.remote import DatasetReplaced
from packer.read.remote import RemoteShards
from packer.storage.cache import ChecksumMismatch
from packer.storage.emulate import Fault
from packer.storage.faults import AccessDenied
from packer.write.convert import convert

FORMAT_OPTIONS: dict[str, dict] = {"mosaic": {"tile": "32x48"}}
URL = "s3://bucket/ds.lmdb"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Every format converted from one folder (small shards: several per dataset), side by side."""
    base = tmp_path_factory.mktemp("remote-read")
    src = make_imagefolder(base / "imgs", classes=3, per_class=8)
    root = base / "root"
    for name in FORMATS:
        convert(src, root / f"ds.{name}", to=name, shard_bytes=6_000, workers=0, progress=False,
                **FORMAT_OPTIONS.get(name, {}))
    return root


@pytest.fixture
def served(tmp_path, datasets):
    """A fresh emulated store (its counts this test's) serving the lmdb dataset as s3://bucket/ds.lmdb."""
    server = serve_copy(datasets / "ds.lmdb", tmp_path / "root")
    yield server
    server.stop()


def _options(server) -> dict:
    return {**CREDENTIALS, "endpoint": server.server.endpoint}


def _open(server, tmp_path, url: str = URL, cache: str = "cache", **kw):
    kw.setdefault("remote_mode", "shard")  # these tests are whole-shard mode's (ranged: test_ranged_read.py)
    return open_served(server, tmp_path / cache, url, **kw)


def _counts(server) -> dict:
    return server.server.stats.settled()


def _files(ds) -> RemoteShards:
    """The dataset's shard files (whole-shard mode's reader)."""
    assert isinstance(ds.store.files, RemoteShards)
    return ds.store.files


def _shard_bytes(ds) -> list[int]:
    return [sum(f.num_bytes for f in s.files) for s in ds.manifest.shards]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_format_reads_back_as_the_same_dataset_as_local(fmt, datasets, tmp_path):
    server = Emulated(datasets)
    try:
        local = open_dataset(datasets / f"ds.{fmt}", image="numpy")
        with _open(server, tmp_path, f"s3://bucket/ds.{fmt}", image="numpy") as ds:
            assert type(ds) is type(local) and len(ds.manifest.shards) > 1
            assert (ds.classes, ds.targets, ds.samples) == (local.classes, local.targets, local.samples)
            assert repr(ds).startswith(f"{type(local).__name__}('s3://bucket/ds.{fmt}', format={fmt}")
            everything = list(range(len(ds)))
            for (img, label), (want, want_label) in zip(ds.__getitems__(everything), local.__getitems__(everything),
                                                        strict=True):
                assert label == want_label and (img == want).all()
    finally:
        server.stop()


def test_against_moto_a_url_reads_as_the_local_folder_and_file_urls_are_local_paths(moto_endpoint, bucket, datasets,
                                                                                     tmp_path):
    url = f"s3://{bucket}/ds.lmdb"
    with s3_store(moto_endpoint, url) as store:
        upload(store, datasets / "ds.lmdb")
    local = open_dataset(datasets / "ds.lmdb", image="tensor", fields="all")
    with open_dataset(url, cache_dir=tmp_path / "cache", storage_options={**CREDENTIALS, "endpoint": moto_endpoint},
                      image="tensor", fields="all") as ds:
        for i in range(len(ds)):
            got, want = ds[i], local[i]
            assert got.keys() == want.keys() and torch.equal(got["image"], want["image"])
            assert {k: v for k, v in got.items() if k != "image"} == {k: v for k, v in want.items() if k != "image"}
    with open_dataset(f"file://{datasets / 'ds.lmdb'}") as ds:
        assert ds.root == datasets / "ds.lmdb" and len(ds) == len(local)


def test_plain_http_and_the_ram_cache_read_the_same_samples(served, tmp_path, datasets):
    local = open_dataset(datasets / "ds.lmdb", image="numpy")
    url = f"{served.server.endpoint}/bucket/ds.lmdb"  # http: a HEAD per object instead of a listing
    with open_dataset(url, cache_dir=tmp_path / "cache", image="numpy") as ds:
        assert repr(ds).startswith(f"LMDBDataset('{url}'")
        assert all((ds[i][0] == local[i][0]).all() for i in range(len(ds)))
    with _open(served, tmp_path, cache="ram", image="numpy") as ds, open_dataset(
            URL, cache="ram", cache_options={"progress": False}, cache_dir=tmp_path / "ram",
            storage_options=_options(served), image="numpy") as cached:
        assert all((cached[i][0] == local[i][0]).all() for i in range(len(ds)))


def test_a_ram_cached_url_reads_its_epochs_from_ram_fetching_nothing(served, tmp_path):
    """cache="ram" over a disk cache smaller than the dataset: once the RAM copy is filled, the sampler's passes
    fetch no shard ahead (its samples come from RAM, not from the shard files)."""
    with _open(served, tmp_path, cache_limit=1 << 30) as probe:
        limit = 4 * max(_shard_bytes(probe))  # fewer shards than the dataset holds
        assert len(probe.manifest.shards) > 4
    with open_dataset(URL, cache="ram", cache_options={"progress": False}, cache_dir=tmp_path / "ram",
                      cache_limit=limit, storage_options=_options(served), image="numpy") as cached:
        filled = _counts(served)
        sampler = packer.BlockShuffleSampler(cached, batch_size=4, block_bytes=3000)
        for _ in range(2):
            assert sorted(cached[i][1] for i in sampler) == sorted(cached.targets)
        assert _counts(served)["body_bytes"] == filled["body_bytes"]


def test_a_failed_ram_cache_closes_the_url_dataset_it_was_made_of(served, tmp_path):
    before = set(threading.enumerate())  # threads another test left for the collector are not this one's
    with pytest.raises(PackerError):
        open_dataset(URL, cache="ram", cache_options={"shm_dir": str(tmp_path / "nowhere")},
                     cache_dir=tmp_path / "cache", storage_options=_options(served))
    assert [t.name for t in set(threading.enumerate()) - before if t.name == "packer-downloader-client"] == []


def test_a_fetch_dropped_by_another_thread_between_ask_and_wait_is_still_waited_for(served, tmp_path, monkeypatch):
    """Another thread may close idle readers (dropping their fetches) between this thread's asking for a shard and
    its waiting: the wait is on the fetch it asked for, never a lookup that fails as a damaged dataset."""
    from packer.read.remote import RemoteShards

    asked = RemoteShards.start

    def then_dropped(self, k, *args, **kwargs):
        fut = asked(self, k, *args, **kwargs)
        state = self._process.get()
        with state.lock:
            state.futures.pop(k, None)  # what the other thread's closing of idle readers does
        return fut

    monkeypatch.setattr(RemoteShards, "start", then_dropped)
    with _open(served, tmp_path, image="numpy") as ds:
        assert [ds[i][1] for i in range(len(ds))] == ds.targets


def _labels(batches) -> list[int]:
    return [int(x) for _, labels in batches for x in labels]


def test_dataloader_workers_forked_and_threadloader_read_every_sample_once(served, tmp_path, datasets):
    local = open_dataset(datasets / "ds.lmdb", image="tensor")
    with _open(served, tmp_path, image="tensor") as ds:
        sampler = packer.BlockShuffleSampler(ds, batch_size=4, block_bytes=3000, seed=2)
        order = [int(i) for i in sampler.order(0)]
        want = [local.targets[i] for i in order]
        got = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=packer.collate,
                         multiprocessing_context="fork")
        batches = list(got)
        assert _labels(batches) == want and sorted(order) == list(range(len(ds)))
        first = [img for img in batches[0][0]]
        assert all(torch.equal(a, local[i][0]) for a, i in zip(first, order[:4], strict=True))
        sampler.set_epoch(0)
        assert _labels(ThreadLoader(ds, batch_size=4, sampler=sampler, num_threads=3)) == want


def test_spawned_dataloader_workers_read_through_the_pickled_dataset(spawned):
    """Read by the session's spawned workers (_spawned_shards); the test closes the dataset and stops the server."""
    server, ds, local_path = spawned.context
    try:
        local = open_dataset(local_path, image="tensor")
        images = [img for imgs, _ in spawned.values() for img in imgs]
        assert len(images) == len(ds) and all(torch.equal(a, local[i][0]) for i, a in enumerate(images))
    finally:
        ds.close()
        server.stop()


@probe_for(test_spawned_dataloader_workers_read_through_the_pickled_dataset)
def _spawned_shards(tmp_path_factory):
    """Batches of 6 collated by packer.collate, read by spawned workers from a whole-shard URL dataset whose
    connection the parent has used. Context: (the server, the dataset, the local copy)."""
    base = tmp_path_factory.mktemp("remote-spawn")
    local = Path(convert(make_imagefolder(base / "imgs", classes=3, per_class=8), base / "ds.lmdb", shard_bytes=6_000,
                         workers=0, progress=False).output)
    server = serve_copy(local, base / "root")
    ds = _open(server, base, image="tensor")
    ds[0]  # the parent used its connection before the workers start
    return Fetch(ds, batches_of(len(ds), 6), packer.collate), (server, ds, local)


@pytest.fixture(scope="module")
def shard_counts(tmp_path_factory):
    """One folder of 300 small photos converted twice: in 4 shards (few/ds.lmdb) and one per photo (many/)."""
    base = tmp_path_factory.mktemp("shard-counts")
    src = make_imagefolder(base / "imgs", classes=3, per_class=100)
    total = sum(f.stat().st_size for f in src.rglob("*.jpg"))
    for name, shard_bytes in (("few", total // 4 + 1), ("many", 1)):
        convert(src, base / name / "ds.lmdb", to="lmdb", shard_bytes=shard_bytes, workers=0, progress=False)
    return base


@pytest.mark.parametrize("mode", ["shard", "ranged"])
def test_a_url_datasets_pickle_does_not_grow_with_its_shards_and_a_spawned_worker_reloads_it(shard_counts, tmp_path,
                                                                                            mode):
    """A spawned DataLoader worker gets its dataset through a 64 KiB pipe that Process.start blocks on: the
    manifest, every object's ETag and the shard readers travel as references to the node's cache, so 300 shards
    pickle as 4 do; the worker reloads them from there, reads the right samples and asks the store nothing."""
    servers = {name: serve_copy(shard_counts / name / "ds.lmdb", tmp_path / name) for name in ("few", "many")}
    try:
        sizes = {}
        for name, server in servers.items():
            with _open(server, tmp_path, cache=f"cache-{name}", remote_mode=mode) as ds:
                sizes[name] = (len(ds.manifest.shards), len(pickle.dumps(ds)))
        assert sizes["few"][0] == 4 and sizes["many"][0] == 300
        assert abs(sizes["many"][1] - sizes["few"][1]) < 256, sizes  # before: about 570 bytes more per shard
        local = open_dataset(shard_counts / "many" / "ds.lmdb", image="tensor")
        with _open(servers["many"], tmp_path, cache="cache-many", remote_mode=mode, image="tensor") as ds:
            read_all(ds, "main")  # every shard or group in the node's cache: a worker's request would be its own
            before = _counts(servers["many"])
            got = DataLoader(ds, batch_size=50, num_workers=1, collate_fn=packer.collate,
                             multiprocessing_context="spawn")
            images = [img for imgs, _ in got for img in imgs]
            assert len(images) == len(ds) and all(torch.equal(a, local[i][0]) for i, a in enumerate(images))
            assert _counts(servers["many"])["requests"] == before["requests"]
    finally:
        for server in servers.values():
            server.stop()


@pytest.mark.parametrize("changed", ["manifest", "objects"])
def test_an_unpickled_url_dataset_refuses_a_node_cache_changed_since_the_open(served, tmp_path, changed):
    """What a worker reloads from the node's cache (the manifest, the record of every object's ETag) is checked
    against the digests its pickle holds: a copy changed there is refused in one line naming the URL, never read
    with the original's index."""
    with _open(served, tmp_path) as ds:
        blob = pickle.dumps(ds)
        folder = _files(ds).remote.folder
    target = folder / "manifest.json" if changed == "manifest" else next(folder.glob("objects-*.json"))
    target.write_bytes(target.read_bytes() + b"\n")  # the same JSON, other bytes
    with pytest.raises(packer.DatasetError, match=r"^s3://bucket/ds.lmdb[^\n]*: open the dataset again$"):
        pickle.loads(blob)


@pytest.mark.parametrize("changed", ["manifest", "objects"])
def test_opening_again_mends_a_node_cache_changed_since_an_open(served, tmp_path, changed):
    """What the refusal above tells (open the dataset again) works: the next open's pickle reloads in a worker,
    whatever another user or a crash left in the node's cache under the record's name (here: an empty file)."""
    with _open(served, tmp_path) as ds:
        pickle.dumps(ds)
        folder = _files(ds).remote.folder
    target = folder / "manifest.json" if changed == "manifest" else next(folder.glob("objects-*.json"))
    target.write_bytes(b"")
    with _open(served, tmp_path) as ds:
        copy = pickle.loads(pickle.dumps(ds))
        assert bytes(copy.read_payload(len(ds) - 1)) == bytes(ds.read_payload(len(ds) - 1))
        copy.close()


@pytest.mark.parametrize("mode", ["shard", "ranged"])
@pytest.mark.parametrize("meanwhile", ["nothing", "replaced", "another object added"])
def test_a_url_dataset_unpickled_on_another_node_fetches_what_it_reloads_the_version_opened(served, tmp_path,
                                                                                           meanwhile, mode):
    """Unpickled where the node's cache lacks the manifest and the record of the objects (another node: a dataset
    sent to a Dask or Ray task; or the cache cleared), the worker fetches the manifest as opened and lists the
    objects again, both checked: it reads the samples of the open, and a dataset replaced in the bucket since is
    one DatasetReplaced naming the URL (before: a DatasetError naming the cache's manifest path, 'missing'); an object
    added under the prefix that is not a file of the dataset changes nothing."""
    with _open(served, tmp_path, remote_mode=mode) as ds:
        blob = pickle.dumps(ds)
        want = bytes(ds.read_payload(len(ds) - 1))
    shutil.rmtree(tmp_path / "cache")  # the other node's cache, at the same path: nothing in it
    if meanwhile == "replaced":
        last = ds.manifest.shards[-1].files[0].name
        served.write(f"ds.lmdb/{last}", (served.root / "ds.lmdb" / last).read_bytes()[::-1])  # a new ETag
        with pytest.raises(DatasetReplaced, match=r"^s3://bucket/ds.lmdb: the dataset was replaced since it was "
                                                  r"opened[^\n]*: restart the job$"):
            pickle.loads(blob)
        return
    if meanwhile == "another object added":  # not a file of the dataset: its prefix holds other objects too
        served.write("ds.lmdb/notes.txt", b"added after the open")
    copy = pickle.loads(blob)
    try:
        assert bytes(copy.read_payload(len(copy) - 1)) == want
    finally:
        copy.close()


def test_the_next_shards_of_the_order_are_fetched_before_they_are_read(served, tmp_path):
    with _open(served, tmp_path, cache_limit=1 << 30) as probe:
        limit = 5 * max(_shard_bytes(probe))  # the shard read, two ahead and two more
    with _open(served, tmp_path, cache="small", cache_limit=limit) as ds:
        assert ds.store.files.read_ahead == 2
        sampler = packer.BlockShuffleSampler(ds, block_bytes=3000, open_blocks=1, run=1, seed=1)
        stored = sampler.stored_order(0)
        shards = list(dict.fromkeys(ds.store.locate(int(p))[0] for p in stored))
        it = iter(sampler)
        next(it)  # the pass's first index handed out, nothing read
        root = ds.store.files.remote.shard_root
        ahead = [f.name for k in shards[1:3] for f in ds.manifest.shards[k].files]
        wait_until(lambda: all((root / name).exists() for name in ahead), "the next two shards fetched ahead")
        later = [f.name for k in shards[3:] for f in ds.manifest.shards[k].files]
        assert not any((root / name).exists() for name in later)  # not the whole dataset: what the limit allows


def test_a_second_epoch_with_a_cache_as_large_as_the_dataset_fetches_nothing(served, tmp_path):
    with _open(served, tmp_path, image="tensor") as ds:
        sampler = packer.BlockShuffleSampler(ds, batch_size=4, block_bytes=3000)
        loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=packer.collate,
                            multiprocessing_context="fork")
        first = sorted(_labels(loader))
        before = _counts(served)
        assert before["body_bytes"] >= sum(_shard_bytes(ds))  # every shard was fetched in the first
        assert sorted(_labels(loader)) == first  # the next epoch (another order)
        after = _counts(served)
        assert (after["gets"], after["body_bytes"]) == (before["gets"], before["body_bytes"])


def test_a_cache_of_three_shards_reads_an_epoch_once_each_fetching_only_what_it_reads(tmp_path):
    src = make_imagefolder(tmp_path / "imgs", classes=4, per_class=10)
    convert(src, tmp_path / "root" / "ds.lmdb", to="lmdb", shard_bytes=6_000, workers=0, progress=False)
    server = Emulated(tmp_path / "root")
    try:
        with _open(server, tmp_path, cache_limit="64MB") as probe:
            sizes = _shard_bytes(probe)
            metadata = _counts(server)["body_bytes"]
        limit = 3 * max(sizes)
        assert sum(sizes) > 2 * limit  # the dataset is far larger than the cache
        with _open(server, tmp_path, cache="small", cache_limit=limit, image="tensor") as ds:
            ds.store.files.lag = 5  # a shard counts as read once the batch after it is handed out (batches of 5)
            sampler = packer.BlockShuffleSampler(ds, block_bytes=3000, open_blocks=2, seed=3)
            stored = sampler.stored_order(0)
            order = [int(i) for i in sampler.order(0)]
            shard_of = [ds.store.locate(int(p))[0] for p in stored]
            segments = [k for n, k in enumerate(shard_of) if n == 0 or shard_of[n - 1] != k]  # shards entered
            local = open_dataset(tmp_path / "root" / "ds.lmdb", image="tensor")
            images = [img for imgs, _ in DataLoader(ds, batch_size=5, sampler=sampler, collate_fn=packer.collate)
                      for img in imgs]
            assert sorted(order) == list(range(len(ds)))  # every sample once, each the local one's pixels
            assert len(images) == len(order) and all(torch.equal(a, local[i][0]) for a, i in zip(images, order))
            stats = ds.store.files.remote.client.stats()
            assert stats["usage"] <= limit and stats["evicted"] > 0
            fetched = _counts(server)["body_bytes"] - 2 * metadata  # the probe's and this open's metadata
            assert ds.store.files.read_ahead == 0  # three shards: nothing fetched ahead, each fetched when entered
            assert fetched <= sum(sizes[k] for k in segments)  # at most each shard once per time it is read
    finally:
        server.stop()


def test_eviction_keeps_the_shard_the_pass_reads_again_soonest(served, tmp_path):
    """A cache of two shards, an order reading shards A, B, C, then A again: told the pass's order, the node evicts
    B (never read again) for C, not A (least recently used), so A is fetched once."""
    with _open(served, tmp_path, cache_limit=1 << 30) as probe:
        limit = 2 * max(_shard_bytes(probe)) + max(_shard_bytes(probe)) // 2  # two shards, not three
    with _open(served, tmp_path, cache="small", cache_limit=limit) as ds:
        ds.store.files.keep_open = 1  # a reader closed once another shard is read: its files are read again
        assert ds.store.files.read_ahead == 0  # two shards: the one read and one more, nothing fetched ahead
        starts = ds.store.starts.tolist() + [len(ds)]
        a, b, c = (list(range(starts[k], starts[k + 1])) for k in range(3))
        stored = np.array(a[:1] + b + c + a[1:])
        public = [ds.index_map.public(int(p)) for p in stored]
        before = _counts(served)["body_bytes"]
        got = [ds[i][1] for i in ds.follow(stored, iter(public), 0)]
        assert got == [ds.targets[i] for i in public]
        sizes = _shard_bytes(ds)
        fetched = _counts(served)["body_bytes"] - before
        # A once: a second fetch of any shard would add a whole one (a part resent after a timeout of a loaded
        # machine adds a few bytes, seen once in a full run)
        assert sizes[0] + sizes[1] + sizes[2] <= fetched < sizes[0] + sizes[1] + sizes[2] + min(sizes)


# ---- faults, in the main process, forked DataLoader workers and ThreadLoader threads ----


@pytest.mark.parametrize("how", ["main", "fork", "threads"])
def test_a_shard_replaced_mid_epoch_is_one_error_naming_the_url(served, tmp_path, how):
    with _open(served, tmp_path, image="tensor") as ds:
        ds[0]  # the first shard fetched, the job under way
        last = ds.manifest.shards[-1].files[0].name
        path = served.root / "ds.lmdb" / last
        served.write(f"ds.lmdb/{last}", path.read_bytes()[::-1])  # a new upload: a new ETag
        with pytest.raises(DatasetReplaced, match="s3://bucket/ds.lmdb: the dataset was replaced while being read"):
            read_all(ds, how)


@pytest.mark.parametrize("how", ["main", "fork", "threads"])
def test_a_damaged_shard_is_one_error_naming_its_url_never_pixels(served, tmp_path, how):
    name = None
    with _open(served, tmp_path) as ds:
        name = ds.manifest.shards[1].files[0].name
    data = bytearray((served.root / "ds.lmdb" / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    served.write(f"ds.lmdb/{name}", bytes(data))
    with _open(served, tmp_path, cache="other", image="tensor") as ds:
        with pytest.raises(ChecksumMismatch, match=f"s3://bucket/ds.lmdb/{name}: sha256"):
            read_all(ds, how)


def test_404_403_at_open_and_no_credentials_in_repr_or_errors(served, tmp_path):
    with pytest.raises(InputNotFoundError, match=r"^s3://bucket/nothing.lmdb: no packer dataset there"):
        _open(served, tmp_path, "s3://bucket/nothing.lmdb")
    secret = "SECRET-DO-NOT-SHOW-42"
    options = {**_options(served), "aws_secret_access_key": secret}
    shown = []
    with open_dataset(URL, cache_dir=tmp_path / "cache", storage_options=options) as ds:
        shown += [repr(ds), str(ds.store.files.name), repr(ds.store.files)]
        ds[0]
    served.faults.add(Fault("status", 403, "AccessDenied"), method="*", times=-1)
    with pytest.raises(AccessDenied, match=r"^s3://bucket/ds.lmdb/manifest.json: access denied") as err:
        open_dataset(URL, cache_dir=tmp_path / "cache", storage_options=options)
    shown += [str(err.value), repr(err.value)]
    assert not any(secret in text for text in shown), shown


def test_a_format_class_given_a_url_refuses_it_in_one_line():
    with pytest.raises(PackerError, match="^object storage is not supported yet by LMDBDataset"):
        packer.LMDBDataset(URL)


# ---- multi-node: two nodes of two ranks, each node its own cache and its own server endpoint to count ----


def _rank(url: str, endpoint: str, cache_dir: str, rank: int, out) -> None:
    try:
        ds = open_dataset(url, cache_dir=cache_dir, storage_options={**CREDENTIALS, "endpoint": endpoint},
                          image="tensor", remote_mode="shard")
        sampler = packer.BlockShuffleSampler(ds, batch_size=3, block_bytes=3000, num_replicas=4, rank=rank)
        got = [int(i) for i in sampler.order(0)]
        labels = [int(x) for _, y in DataLoader(ds, batch_size=3, sampler=sampler, collate_fn=packer.collate)
                  for x in y]
        assert labels == [ds.targets[i] for i in got]
        shards = sorted({ds.store.locate(int(p))[0] for p in sampler.stored_order(0)})
        ds.close()
        out.put((rank, got, shards))
    except BaseException as exc:  # noqa: BLE001  (reported to the test)
        out.put((rank, repr(exc), []))


def test_two_nodes_of_two_ranks_read_disjoint_samples_and_fetch_only_their_ranks_shards(tmp_path, datasets):
    shutil.copytree(datasets / "ds.lmdb", tmp_path / "root" / "ds.lmdb")
    nodes = [Emulated(tmp_path / "root"), Emulated(tmp_path / "root")]  # one endpoint per node: counted apart
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(URL, nodes[r // 2].server.endpoint, str(tmp_path / f"node{r // 2}"),
                                                 r, out)) for r in range(4)]
        for p in procs:
            p.start()
        results = {r: (got, shards) for r, got, shards in (out.get(timeout=240) for _ in procs)}
        for p in procs:
            p.join(60)
        assert all(isinstance(got, list) for got, _ in results.values()), results
        manifest = read_manifest(tmp_path / "root" / "ds.lmdb")
        n, files = manifest.num_samples, manifest.shards
        sizes = [sum(f.num_bytes for f in s.files) for s in files]
        everything = [i for got, _ in results.values() for i in got]
        assert sorted(everything) == list(range(n))  # disjoint, each sample once per epoch (24 = 4 x 6)
        for node in (0, 1):
            touched = set(results[2 * node][1]) | set(results[2 * node + 1][1])
            assert len(touched) < len(files)  # the test means something: a node reads part of the dataset
            root = next((tmp_path / f"node{node}").rglob("files"))
            held = {k for k, s in enumerate(files) if all(any(root.rglob(f.name)) for f in s.files)}
            assert held == touched  # its ranks' shards, and only those
        # each node's server sent the same metadata once and its ranks' shards once each, nothing else
        rest = [_counts(nodes[node])["body_bytes"]
                - sum(sizes[k] for k in set(results[2 * node][1]) | set(results[2 * node + 1][1])) for node in (0, 1)]
        assert rest[0] == rest[1] > 0
    finally:
        for node in nodes:
            node.stop()
