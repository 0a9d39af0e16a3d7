"""open_dataset(URL) in ranged mode (packer/read/ranged.py): each batch's payloads fetched as ranged GETs of
neighbouring samples into the node's cache, each checked against the CRC-32 its conversion recorded
(packer/layout/ranges.py), against moto's S3 server and the emulated store (counting GETs and bytes at the server)."""

from __future__ import annotations

import concurrent.futures
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from support.imagesets import jpeg_bytes, make_imagefolder
from support.spawned import Fetch, batches_of, probe_for
from support.storage_servers import CREDENTIALS, Emulated, open_served, read_all, s3_store, serve_copy, upload
from torch.utils.data import DataLoader

import packer
from packer import PackerError, ThreadLoader, open_dataset
from packer.errors import OptionError
from packer.layout.ranges import PayloadRanges
from packer.layout.remote import DatasetReplaced
from packer.read.ranged import GROUP_BYTES, SLACK, Groups, RangedSource
from packer.read.remote import RemoteShards
from packer.read.store import ShardStore
from packer.storage.cache import ChecksumMismatch
from packer.write.convert import convert

RANGED = ["lmdb", "memmap", "recordio", "hdf5", "n5", "pth", "safetensors"]  # payloads are plain byte ranges
URL = "s3://bucket/ds.lmdb"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    """Photos of one size (about 28 KB each: lmdb keeps them in overflow pages, as real photos), every format
    with ranges converted in shards of about 200 KB, plus bmp (no ranges)."""
    base = tmp_path_factory.mktemp("ranged-read")
    root = base / "root"
    for name in RANGED:
        convert(_photos(base), root / f"ds.{name}", to=name, shard_bytes=200_000, workers=0, progress=False)
    convert(make_imagefolder(base / "small"), root / "ds.bmp", to="bmp", shard_bytes=6_000, workers=0,
            progress=False)
    return root


def _photos(base: Path) -> Path:
    """base/imgs: 3 classes of 8 photos of 192x256 (made once)."""
    if not (base / "imgs").exists():
        rng = np.random.default_rng(0)
        for c in range(3):
            (base / "imgs" / f"c{c}").mkdir(parents=True)
            for i in range(8):
                (base / "imgs" / f"c{c}" / f"i{i:02d}.jpg").write_bytes(jpeg_bytes(rng, 192, 256))
    return base / "imgs"


@pytest.fixture
def served(tmp_path, datasets):
    """A fresh emulated store (its counts this test's) serving the lmdb dataset as s3://bucket/ds.lmdb."""
    server = serve_copy(datasets / "ds.lmdb", tmp_path / "root")
    yield server
    server.stop()


def _open(server, tmp_path, url: str = URL, cache: str = "cache", **kw):
    return open_served(server, tmp_path / cache, url, **kw)


def _ranged(ds) -> RangedSource:
    """The dataset's ranged source (its reader in ranged mode)."""
    assert isinstance(ds.source, RangedSource)
    return ds.source


def _shards(ds) -> RemoteShards:
    """The dataset's shard files (its reader in whole-shard mode)."""
    assert isinstance(ds.store.files, RemoteShards)
    return ds.store.files


def _counts(server) -> dict:
    return server.server.stats.settled()


@pytest.mark.parametrize("fmt", RANGED)
def test_every_format_with_ranges_reads_in_ranged_mode_the_local_samples(fmt, datasets, tmp_path):
    server = Emulated(datasets)
    try:
        local = open_dataset(datasets / f"ds.{fmt}", image="numpy")
        with _open(server, tmp_path, f"s3://bucket/ds.{fmt}", image="numpy") as ds:
            assert isinstance(ds.source, RangedSource) and len(ds.manifest.shards) > 1  # "auto": ranged
            assert (ds.classes, ds.targets, ds.samples) == (local.classes, local.targets, local.samples)
            got = ds.__getitems__(list(range(len(ds))))
            assert all((a[0] == local[i][0]).all() and a[1] == local[i][1] for i, a in enumerate(got))
            assert all(bytes(ds.read_payload(i)) == bytes(local.read_payload(i)) for i in range(len(ds)))
    finally:
        server.stop()


def test_against_moto_a_url_reads_in_ranged_mode_as_the_local_folder(moto_endpoint, bucket, datasets, tmp_path):
    url = f"s3://{bucket}/ds.lmdb"
    with s3_store(moto_endpoint, url) as store:
        upload(store, datasets / "ds.lmdb")
    local = open_dataset(datasets / "ds.lmdb", image="tensor", fields="all")
    with open_dataset(url, cache_dir=tmp_path / "cache", storage_options={**CREDENTIALS, "endpoint": moto_endpoint},
                      image="tensor", fields="all", remote_mode="ranged") as ds:
        assert isinstance(ds.source, RangedSource)
        for i in range(len(ds)):
            got, want = ds[i], local[i]
            assert got.keys() == want.keys() and torch.equal(got["image"], want["image"])


def test_forked_workers_threadloader_and_get_batch_read_through_the_ranged_source(served, tmp_path, datasets):
    local = open_dataset(datasets / "ds.lmdb", image="tensor")
    with _open(served, tmp_path, image="tensor") as ds:
        sampler = packer.BlockShuffleSampler(ds, batch_size=4, block_bytes=60_000, seed=2)
        order = [int(i) for i in sampler.order(0)]
        batches = list(DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=packer.collate,
                                  multiprocessing_context="fork"))
        images = [img for imgs, _ in batches for img in imgs]
        assert sorted(order) == list(range(len(ds)))
        assert all(torch.equal(a, local[i][0]) for a, i in zip(images, order, strict=True))
        sampler.set_epoch(0)
        got = [int(y) for _, ys in ThreadLoader(ds, batch_size=4, sampler=sampler, num_threads=3) for y in ys]
        assert got == [local.targets[i] for i in order]
        images, labels = ds.get_batch(order[:6], layout="NCHW")
        assert torch.equal(images, torch.stack([local[i][0] for i in order[:6]]))
        assert labels.tolist() == [local.targets[i] for i in order[:6]]


def test_the_first_batch_fetches_only_its_samples_ranges_not_whole_shards(served, tmp_path):
    with _open(served, tmp_path, image="tensor") as ds:
        opened = _counts(served)
        sampler = packer.BlockShuffleSampler(ds, batch_size=4, block_bytes=60_000, seed=5)
        batch = [int(i) for i in sampler.order(0)[:4]]
        ds.__getitems__(batch)  # one batch, no sampler pass followed: nothing read ahead
        after = _counts(served)
        groups = _ranged(ds).groups
        own = sorted({int(groups.of[ds.position(i)]) for i in batch})
        shards = {ds.locate(i)[0] for i in batch}
        shard_bytes = sum(f.num_bytes for k in shards for f in ds.manifest.shards[k].files)
        fetched = after["body_bytes"] - opened["body_bytes"]
        assert fetched == sum(groups.size(g) for g in own) < shard_bytes
        assert 1 <= after["gets"] - opened["gets"] <= len(own)  # adjacent groups may share a GET


def test_epoch_one_fetches_at_most_1_1x_what_it_delivers_and_epoch_two_nothing(served, tmp_path):
    with _open(served, tmp_path, image="tensor") as ds:
        opened = _counts(served)
        sampler = packer.BlockShuffleSampler(ds, batch_size=4, block_bytes=60_000)
        loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, collate_fn=packer.collate,
                            multiprocessing_context="fork")
        first = sorted(int(y) for _, ys in loader for y in ys)
        one = _counts(served)
        delivered = int(ds.source.index.nbytes.sum())
        fetched = one["body_bytes"] - opened["body_bytes"]
        assert delivered <= fetched <= 1.1 * delivered
        assert fetched < sum(f.num_bytes for s in ds.manifest.shards for f in s.files)  # not the whole shards
        sampler.set_epoch(1)
        assert sorted(int(y) for _, ys in loader for y in ys) == first
        two = _counts(served)
        assert (two["gets"], two["body_bytes"]) == (one["gets"], one["body_bytes"])


@pytest.mark.parametrize("how", ["main", "fork", "threads"])
def test_a_damaged_byte_of_a_payload_in_the_bucket_is_one_error_naming_its_url(served, tmp_path, datasets, how):
    ranges = PayloadRanges.load(datasets / "ds.lmdb", (local := open_dataset(datasets / "ds.lmdb")).manifest,
                                local.store.index)
    assert ranges is not None
    pos = 9
    shard, _ = local.store.locate(pos)
    name = local.manifest.shards[shard].files[int(ranges.file[pos])].name
    data = bytearray((served.root / "ds.lmdb" / name).read_bytes())
    data[int(ranges.offset[pos]) + int(local.store.index.nbytes[pos]) // 2] ^= 0xFF
    served.write(f"ds.lmdb/{name}", bytes(data))
    with _open(served, tmp_path, image="tensor") as ds:
        with pytest.raises(ChecksumMismatch, match=rf"s3://bucket/ds.lmdb/{name} bytes \d+-\d+: crc32 "):
            read_all(ds, how)


def test_a_damaged_node_cache_entry_is_an_error_naming_the_url_never_pixels(served, tmp_path):
    with _open(served, tmp_path, image="tensor") as ds:
        ds[0]
        source = _ranged(ds)
        g = int(source.groups.of[ds.position(0)])
        path = source.remote.client.path(source.entry(g))
        path.chmod(0o644)
        data = bytearray(path.read_bytes())
        at = int(source.groups.offset[ds.position(0)] - source.groups.start[g]) + 100
        data[at] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(ChecksumMismatch, match=r"s3://bucket/ds.lmdb/.* \(sample \d+, node cache"):
            ds[0]


def test_remote_mode_chooses_the_reader_and_is_refused_where_ranges_are_missing(served, tmp_path, datasets):
    with _open(served, tmp_path, remote_mode="shard") as ds:
        assert isinstance(ds.source, ShardStore) and ds.source is ds.store
        assert (ds[3][1], len(ds)) == (open_dataset(datasets / "ds.lmdb")[3][1], 24)
    with pytest.raises(OptionError, match="unknown remote_mode 'ranges'"):
        _open(served, tmp_path, remote_mode="ranges")
    shutil.copytree(datasets / "ds.bmp", served.root / "ds.bmp")
    with _open(served, tmp_path, "s3://bucket/ds.bmp") as ds:
        assert isinstance(ds.source, ShardStore)  # auto: no ranges recorded, whole-shard mode
        ds[0]
    with pytest.raises(PackerError, match=r"^s3://bucket/ds.bmp: its conversion recorded no payload ranges"):
        _open(served, tmp_path, "s3://bucket/ds.bmp", remote_mode="ranged")


def test_a_cache_smaller_than_the_dataset_reads_an_epoch_evicting_what_the_pass_has_read(served, tmp_path, datasets):
    local = open_dataset(datasets / "ds.lmdb", image="tensor")
    with _open(served, tmp_path, image="tensor", cache_limit=1 << 30) as probe:
        sizes = [_ranged(probe).groups.size(g) for g in range(len(_ranged(probe).groups))]
    limit = 2 * max(sizes)
    assert sum(sizes) > 1.5 * limit  # the dataset is larger than the cache
    with _open(served, tmp_path, cache="small", image="tensor", cache_limit=limit) as ds:
        sampler = packer.BlockShuffleSampler(ds, batch_size=4, block_bytes=60_000, seed=3)
        order = [int(i) for i in sampler.order(0)]
        images = [img for imgs, _ in DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2,
                                                collate_fn=packer.collate, multiprocessing_context="fork")
                  for img in imgs]
        assert sorted(order) == list(range(len(ds)))
        assert all(torch.equal(a, local[i][0]) for a, i in zip(images, order, strict=True))
        stats = _ranged(ds).remote.client.stats()
        assert stats["usage"] <= limit and stats["evicted"] > 0


def test_spawned_dataloader_workers_read_the_pickled_ranged_dataset(spawned):
    """Read by the session's spawned workers (_spawned_ranged); the test closes the dataset and stops the server."""
    server, ds, local_path = spawned.context
    try:
        local = open_dataset(local_path, image="tensor")
        images = [img for imgs, _ in spawned.values() for img in imgs]
        assert len(images) == len(ds) and all(torch.equal(a, local[i][0]) for i, a in enumerate(images))
    finally:
        ds.close()
        server.stop()


@probe_for(test_spawned_dataloader_workers_read_the_pickled_ranged_dataset)
def _spawned_ranged(tmp_path_factory):
    """Batches of 6 collated by packer.collate, read by spawned workers from a ranged URL dataset the parent has
    fetched a group of. Context: (the server, the dataset, the local copy)."""
    base = tmp_path_factory.mktemp("ranged-spawn")
    local = Path(convert(_photos(base), base / "ds.lmdb", shard_bytes=200_000, workers=0, progress=False).output)
    server = serve_copy(local, base / "root")
    ds = _open(server, base, image="tensor")
    ds[0]  # the parent fetched a group before the workers start
    return Fetch(ds, batches_of(len(ds), 6), packer.collate), (server, ds, local)


@pytest.mark.parametrize("mode", ["ranged", "shard"])
def test_a_pass_fetches_its_first_group_or_shard_where_it_starts_before_any_read(served, tmp_path, mode):
    """A DataLoader iterates the sampler in its main process while its workers start (seconds, spawned): the
    group (whole-shard mode: the shard) of the pass's first sample is fetched then, with those after it, so
    reading it asks nothing."""
    with _open(served, tmp_path, image="tensor", remote_mode=mode) as ds:
        first = next(iter(packer.BlockShuffleSampler(ds, batch_size=6, seed=0)))
        fetches = _ranged(ds) if mode == "ranged" else _shards(ds)
        asked = list(fetches._process.get().futures.values())  # this process's fetches: the pass's, so far
        concurrent.futures.wait(asked)
        before = _counts(served)
        ds[first]
        assert _counts(served)["gets"] == before["gets"]


def test_a_pickled_url_dataset_holds_no_per_sample_array_and_reloads_them_asking_the_store_nothing(served, tmp_path):
    """What a spawned DataLoader worker gets: the URL, the version opened and each object's ETag, not the index,
    map or groups (a pickle over the 64 KiB pipe makes Process.start wait for the child: workers start one after
    the other); the copy reloads them from the node's cache, the same, sending the store nothing, and still
    reports a shard replaced in the bucket since the open."""
    with _open(served, tmp_path, image="tensor") as ds:
        ds[0]
        blob = pickle.dumps(ds)
        source = _ranged(ds)
        for array in (ds.index.path_blob, ds.index.nbytes, source.groups.crc, source.groups.offset):
            assert array.tobytes() not in blob
        before = _counts(served)
        copy = pickle.loads(blob)
        try:
            assert _counts(served)["requests"] == before["requests"]  # metadata reloaded from the node's cache
            for name in ("of", "members", "start", "end", "crc"):
                assert np.array_equal(getattr(_ranged(copy).groups, name), getattr(source.groups, name))
            assert np.array_equal(copy.index.labels, ds.index.labels) and copy.presenter.labels is copy.index.labels
            assert all(torch.equal(copy[i][0], ds[i][0]) and copy[i][1] == ds[i][1] for i in range(len(ds)))
            assert copy.index.path_blob.tobytes() not in pickle.dumps(copy)  # a worker's copy pickles small again
            last = ds.manifest.shards[-1].files[0].name
            served.write(f"ds.lmdb/{last}", (served.root / "ds.lmdb" / last).read_bytes()[::-1])  # a new ETag
            again = pickle.loads(blob)
            with pytest.raises(DatasetReplaced, match="s3://bucket/ds.lmdb: the dataset was replaced"):
                _ranged(again).remote.read_range(last, 0, 10)
            again.close()
        finally:
            copy.close()


# ---------------------------------------------------------------- small payloads: groups by file offset


def _groups(offsets: list[int], sizes: list[int], **kw) -> Groups:
    n = len(offsets)
    ranges = PayloadRanges(np.zeros(n, dtype="<i4"), np.asarray(offsets, dtype="<i8"), np.zeros(n, dtype="<u4"))
    return Groups(ranges, np.asarray(sizes, dtype=np.int64), [["shard-00000.lmdb"]], [n], **kw)


def test_groups_follow_file_offsets_not_storage_order():
    # lmdb's leaf pages: 3 values of 1,000 bytes to a 4 KB page, written from the page's end backwards (storage
    # order descends inside a page), 1,000 bytes free at each page's start, the pages themselves out of order
    pages = [3, 0, 1, 5, 2, 4, 7, 6]
    offsets = [p * 4096 + 4096 - 1000 * (k + 1) for p in pages for k in range(3)]
    groups = _groups(offsets, [1000] * len(offsets))
    spans = sorted((int(groups.start[g]), int(groups.end[g])) for g in range(len(groups)))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no byte in two groups: none fetched twice
    assert sum(b - a for a, b in spans) <= (1 + SLACK) * 1000 * len(offsets)  # the free space: at most 1/16 more
    assert len(groups) < len(pages)  # fewer GETs than pages: the smallest gaps are read across
    for g in range(len(groups)):  # each payload in its group's bytes, checked in file order
        pieces = groups.pieces(g)
        assert [p[0] for p in pieces] == sorted(p[0] for p in pieces)
        assert all(groups.start[g] <= p[0] and p[1] <= groups.end[g] for p in pieces)
    assert all(groups.start[groups.of[i]] <= o < groups.end[groups.of[i]] for i, o in enumerate(offsets))
    # payloads in storage order (photos in overflow pages, memmap): one group per group_bytes, as before
    photos = _groups([k * 30_000 for k in range(100)], [29_000] * 100, group_bytes=1 << 20)
    assert len(photos) == 3 and photos.of.tolist() == sorted(photos.of.tolist())
    assert max(photos.size(g) for g in range(len(photos))) <= (1 << 20) + 29_000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An lmdb of 600 JPEGs of 8-24 pixels a side (about 0.5-1.5 KB: values inside lmdb's leaf pages)."""
    base = tmp_path_factory.mktemp("ranged-tiny")
    rng = np.random.default_rng(1)
    for k in range(600):
        path = base / "imgs" / f"c{k % 2}" / f"i{k:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg_bytes(rng, *(int(v) for v in rng.integers(8, 25, size=2))))
    convert(base / "imgs", base / "root" / "tiny.lmdb", to="lmdb", shard_bytes=300_000, workers=0, progress=False)
    return base / "root" / "tiny.lmdb"


def test_small_lmdb_values_fetch_at_most_1_1x_their_bytes_in_few_gets(tiny, tmp_path):
    server = serve_copy(tiny, tmp_path / "root")
    try:
        with _open(server, tmp_path, "s3://bucket/tiny.lmdb", image="tensor") as ds:
            assert isinstance(ds.source, RangedSource) and len(ds.manifest.shards) > 1
            assert int(ds.source.index.nbytes.max()) < 2048
            opened = _counts(server)
            sampler = packer.BlockShuffleSampler(ds, batch_size=8, block_bytes=20_000, seed=2)
            order = [int(i) for i in sampler.order(0)]
            got = [int(y) for _, ys in DataLoader(ds, batch_size=8, sampler=sampler, num_workers=0,
                                                  collate_fn=packer.collate) for y in ys]
            assert got == [ds.targets[i] for i in order] and sorted(order) == list(range(len(ds)))
            one = _counts(server)
            delivered = int(ds.source.index.nbytes.sum())
            fetched = one["body_bytes"] - opened["body_bytes"]
            assert delivered <= fetched <= 1.1 * delivered  # before grouping by file offset: 2.6x
            groups = ds.source.groups
            assert one["gets"] - opened["gets"] <= len(groups) < len(ds) / 4  # a GET per group at most
            assert max(groups.size(g) for g in range(len(groups))) <= GROUP_BYTES
    finally:
        server.stop()
