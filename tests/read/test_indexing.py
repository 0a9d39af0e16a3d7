"""``ds[i]`` is ImageFolder's sample i whatever the storage order, at every public entry point; ``samples`` are
ImageFolder's paths; older datasets (no position map, no absolute source) still open and say so."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.cli import run_cli
from support.fuzzing import _rewrite_checksums
from support.imagefolder import ImageFolder
from support.imagesets import jpeg_bytes
from support.spawned import Fetch, batches_of, probe_for
from torch.utils.data import DataLoader, Subset, default_collate

from packer import PackerError, convert, open_dataset
from packer.read.sampler import BlockBatchSampler, BlockShuffleSampler, block_order
from packer.tools.info import dataset_info, info_rows
from packer.tools.verify import verify


def make_source(root: Path) -> Path:
    """3 classes, one with a nested folder, sizes varying: ImageFolder's order is the sorted walk."""
    rng = np.random.default_rng(5)
    for c, count in (("cat", 7), ("dog", 6), ("eel", 7)):
        for k in range(count):
            sub = root / c / ("deep" if c == "dog" and k % 2 else "") / f"{k:02d}.jpg"
            sub.parent.mkdir(parents=True, exist_ok=True)
            sub.write_bytes(jpeg_bytes(rng, 20 + int(rng.integers(0, 6)), 24 + int(rng.integers(0, 6))))
    return root


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_source(tmp_path_factory.mktemp("indexing") / "src")


@pytest.fixture(scope="module")
def packed(source, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("indexing-out")
    return {
        "lmdb": convert(source, out / "ds.lmdb", workers=0, progress=False, shard_bytes=8_000).output,
        "memmap": convert(source, out / "ds.memmap", to="memmap", payload="raw", resize="16x20", workers=0,
                          progress=False, shard_bytes=4_000).output,
    }


def test_sample_entry_points_follow_imagefolder(packed, source):
    ref = ImageFolder(source)
    ds = open_dataset(packed["lmdb"], image="numpy")
    stored = [os.path.join(source, r) for r in ds.index.rel_paths()]  # the premise: stored i is not ImageFolder's i
    assert stored != [p for p, _ in ref.samples] and sorted(stored) == sorted(p for p, _ in ref.samples)
    assert ds.indexing == "imagefolder" and "indexing=imagefolder" in repr(ds)
    assert ds.classes == ref.classes and ds.class_to_idx == ref.class_to_idx
    assert ds.samples == ds.imgs == ref.samples and ds.targets == ref.targets
    assert ds.relpaths == [os.path.relpath(p, source) for p, _ in ref.samples]
    order = [7, 0, 19, 3, 3, -1]
    items = ds.__getitems__(order)
    payloads = ds.read_payloads(order)
    for k, i in enumerate(order):
        path, label = ref.samples[i]
        data = Path(path).read_bytes()
        want = np.asarray(ref[i][0])
        assert bytes(ds.read_payload(i)) == data and bytes(payloads[k]) == data
        assert np.array_equal(ds[i][0], want) and ds[i][1] == label
        assert np.array_equal(items[k][0], want) and items[k][1] == label
        assert np.array_equal(ds.pixels(i), want)
        assert ds.index_of(path) == ds.index_of(os.path.relpath(path, source)) == i % len(ds)
        shard, pos = ds.locate(i)
        assert bytes(ds.store.readers[shard].read(pos)) == data
    pending = ds.read_ahead(order)  # file order: the sorted storage positions
    pending.wait(len(order) - 1, timeout=10)


def test_batch_entry_points_follow_imagefolder(packed, source):
    """get_batch (bulk fixed-shape reads, and per-sample decoding) and batched() pick ImageFolder's samples."""
    ref = ImageFolder(source)
    raw = open_dataset(packed["memmap"], image="numpy")
    assert raw.fixed_shape is not None
    idx = [12, 1, 5, 19]
    images, labels = raw.get_batch(idx)
    assert labels.tolist() == [ref.targets[i] for i in idx]
    assert all(np.array_equal(images[k].numpy(), raw[i][0]) for k, i in enumerate(idx))
    sorted_images, sorted_labels = raw.batched()[idx]  # storage order inside the batch: same samples
    assert Counter(sorted_labels.tolist()) == Counter(labels.tolist())
    assert {raw.index_of(p) for p, _ in [ref.samples[i] for i in idx]} == set(idx)
    encoded = open_dataset(packed["lmdb"], image="numpy")
    one_size = [i for i in range(len(encoded)) if encoded[i][0].shape == encoded[0][0].shape][:3]
    images, labels = encoded.get_batch(one_size)
    assert labels.tolist() == [ref.targets[i] for i in one_size]
    assert all(np.array_equal(images[k].numpy(), np.asarray(ref[i][0])) for k, i in enumerate(one_size))


@pytest.mark.parametrize("mode", ["ram", "ram-decoded"])
def test_ram_cache_follows_imagefolder(packed, source, mode):
    ref = ImageFolder(source)
    with open_dataset(packed["lmdb"], image="numpy", cache=mode, cache_options={"progress": False}) as ds:
        assert ds.indexing == "imagefolder" and ds.samples == ref.samples and ds.targets == ref.targets
        for i in (0, 9, len(ref) - 1):
            assert np.array_equal(ds[i][0], np.asarray(ref[i][0])) and ds[i][1] == ref.targets[i]
        assert [b[1] for b in ds.__getitems__([4, 2])] == [ref.targets[4], ref.targets[2]]
        assert ds.index_of(ref.samples[6][0]) == 6 and ds.filename(6) == ref.timm_filename(6)
        if mode == "ram":
            assert bytes(ds.read_payload(11)) == Path(ref.samples[11][0]).read_bytes()


def test_samplers_keep_block_locality_and_yield_imagefolder_indices(packed, source):
    ref = ImageFolder(source)
    ds = open_dataset(packed["lmdb"], image="numpy")
    s = BlockShuffleSampler(ds, block_bytes=3_000, batch_size=4, seed=2, warn=False)
    for epoch in (0, 1):
        s.set_epoch(epoch)
        got = list(s)
        assert sorted(got) == list(range(len(ref)))  # every ImageFolder index once
        # the order is made over storage positions (blocks of neighbours on disk), then mapped
        assert got == [ds.index_map.public(p) for p in s.stored_order(epoch)]
        assert [ds[i][1] for i in got[:6]] == [ref.targets[i] for i in got[:6]]
    stored = s.stored_order(0)
    blocks = np.searchsorted(s.bounds, stored, side="right") - 1
    assert np.mean(np.diff(blocks) == 0) > 0.4  # consecutive samples mostly share a block (locality kept)
    bs = BlockBatchSampler(ds, 4, block_bytes=3_000, seed=2, warn=False)
    flat = [i for b in bs for i in b]
    assert Counter(flat) == Counter(range(len(ref)))
    assert flat == block_order(ds, 0, 2, 3_000, batch_size=4).tolist()
    assert list(BlockShuffleSampler(ds, shuffle=False)) == [ds.index_map.public(p) for p in range(len(ds))]


SPLIT = [19, 0, 7, 8, 13, 2, 6]  # a saved split, by ImageFolder index


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_subset_in_dataloader_workers_gets_imagefolder_labels(request, context):
    if context == "spawn":  # read by the session's spawned workers (_spawned_subset)
        source, batches = request.getfixturevalue("spawned").context, request.getfixturevalue("spawned").values()
    else:
        source = request.getfixturevalue("source")
        ds = open_dataset(str(request.getfixturevalue("packed")["memmap"]), image="tensor")
        batches = DataLoader(Subset(ds, SPLIT), batch_size=3, num_workers=2,
                             multiprocessing_context=multiprocessing.get_context(context))
    ref = ImageFolder(source)
    assert [int(v) for _images, labels in batches for v in labels] == [ref.targets[i] for i in SPLIT]


@probe_for(test_subset_in_dataloader_workers_gets_imagefolder_labels)
def _spawned_subset(tmp_path_factory):
    """Batches of 3 of a Subset (a split by ImageFolder index) of a memmap, in spawned workers. Context: the
    source folder."""
    source = make_source(tmp_path_factory.mktemp("indexing") / "src")
    path = convert(source, tmp_path_factory.mktemp("indexing-out") / "ds.memmap", to="memmap", payload="raw",
                   resize="16x20", workers=0, progress=False, shard_bytes=4_000).output
    return Fetch(Subset(open_dataset(path, image="tensor"), SPLIT), batches_of(len(SPLIT), 3), default_collate), source


def _as_old_layout(path: Path, relative_source: bool) -> None:
    """What a dataset written before this change looks like: no position map, no source numbers (and maybe a
    relative source)."""
    (path / "meta" / "position.npy").unlink()
    (path / "meta" / "source_index.npy").unlink()
    m = json.loads((path / "manifest.json").read_text())
    m["meta_files"] = [f for f in m["meta_files"] if f["name"] not in ("meta/position.npy", "meta/source_index.npy")]
    m.pop("extensions")
    m.pop("source_records")
    if relative_source:
        m["source"] = "src"
    (path / "manifest.json").write_text(json.dumps(m))


def test_older_dataset_opens_with_stored_indexing_and_says_so(packed, tmp_path):
    old = tmp_path / "old.lmdb"
    shutil.copytree(packed["lmdb"], old)
    _as_old_layout(old, relative_source=True)
    ds = open_dataset(old, image="numpy")
    assert ds.indexing == "stored" and "indexing=stored" in repr(ds)
    rels = ds.index.rel_paths()
    assert ds.relpaths == rels and ds.extensions is None
    with pytest.warns(UserWarning, match="source_root"):
        assert ds.samples == list(zip(rels, ds.index.labels.tolist()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        assert len(ds.samples) == len(ds)
    new = open_dataset(packed["lmdb"])
    assert bytes(ds.read_payload(3)) == bytes(new.read_payload(new.index_of(rels[3])))
    assert dataset_info(old)["indexing"] == "stored"
    assert any(k == "indexing" and "stored order" in v for k, v in info_rows(old, dataset_info(old)))
    assert any(k == "indexing" and "ImageFolder" in v for k, v in info_rows(new.root, dataset_info(new.root)))
    assert "stored order" in run_cli("info", old).stdout
    assert list(BlockShuffleSampler(ds, shuffle=False)) == list(range(len(ds)))


def test_position_map_is_checked(packed, tmp_path):
    crafted = tmp_path / "crafted.lmdb"
    shutil.copytree(packed["lmdb"], crafted)
    pos = np.load(crafted / "meta" / "position.npy")
    pos[1] = pos[0]  # one sample twice, another never
    np.save(crafted / "meta" / "position.npy", pos)
    _rewrite_checksums(crafted)
    with pytest.raises(PackerError, match="position.npy: not a permutation"):
        open_dataset(crafted)


def test_samples_open_with_pil_and_source_root_override(packed, source, tmp_path):
    ds = open_dataset(packed["lmdb"])
    path, label = ds.samples[5]
    assert os.path.isabs(path) and Image.open(path).convert("RGB").size == ds[5][0].size
    moved = tmp_path / "moved"
    shutil.copytree(source, moved)
    there = open_dataset(packed["lmdb"], source_root=moved)
    assert there.samples == ImageFolder(moved).samples and there.source_root == str(moved)
    assert there.index_of(str(moved / ds.relpaths[5])) == 5
    with pytest.raises(KeyError):
        there.index_of(str(source / ds.relpaths[5]))  # not under the source given


def test_verify_against_checks_the_indexing(packed, source, tmp_path):
    assert verify(packed["lmdb"], against=source).ok
    crafted = tmp_path / "swapped.lmdb"
    shutil.copytree(packed["lmdb"], crafted)
    pos = np.load(crafted / "meta" / "position.npy")
    pos[[0, 1]] = pos[[1, 0]]  # still a permutation: ds[0] and ds[1] swapped
    np.save(crafted / "meta" / "position.npy", pos)
    _rewrite_checksums(crafted)
    with pytest.raises(PackerError, match="source_index.npy: not increasing"):  # the source numbers disagree
        open_dataset(crafted)
    numbers = np.load(crafted / "meta" / "source_index.npy")
    numbers[pos[[0, 1]]] = numbers[pos[[1, 0]]]  # ... unless swapped with them: then only the source tells
    np.save(crafted / "meta" / "source_index.npy", numbers)
    _rewrite_checksums(crafted)
    report = verify(crafted, against=source)
    assert any("ImageFolder's sample 0" in p for p in report.problems), report.problems


def test_positions_of_many_indices_check_each_as_a_list_does(tmp_path):
    """``positions`` checks integer sequences in one vectorized step: same answers and errors as index by index."""
    import torch

    src = make_source(tmp_path / "src")
    ds = open_dataset(convert(src, tmp_path / "ds.lmdb", workers=0, progress=False).output)
    n = len(ds)
    want = [ds.position(i) for i in (0, 5, -1, -n)]
    for given in ([0, 5, -1, -n], np.array([0, 5, -1, -n], np.int32), torch.tensor([0, 5, -1, -n])):
        assert ds.positions(given).tolist() == want
    assert ds.positions(np.array([3, 0], np.uint8)).tolist() == [ds.position(3), ds.position(0)]
    assert ds.positions([]).tolist() == []
    for bad in ([n], [-n - 1], np.array([0, n]), np.array([2**64 - 1], np.uint64), [2**70]):
        with pytest.raises(IndexError, match="out of range"):
            ds.positions(bad)
    for bad in ([1.0], ["0"], [[0]], np.array([0.0])):
        with pytest.raises(TypeError, match="integers"):
            ds.positions(bad)
