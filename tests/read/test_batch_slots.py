"""Worker batches of plain tensors are decoded straight into one block of shared memory (packer.read.slots)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from support.imagesets import make_imagefolder
from support.spawned import Fetch, probe_for
from torch.utils.data import DataLoader

from packer import convert, open_dataset
from packer.diagnose.bench import list_collate
from packer.read.slots import WorkerMemory, views
from packer.tools.sample import photo_like


def worker_slots(ds, stored, **kwargs):
    """The slots a DataLoader worker's batch of these storage positions gets (as inside a worker), or None."""
    got = ds.pipeline.slots(np.asarray(stored, dtype=np.int64), WorkerMemory(in_worker=True), **kwargs)
    return None if got is None else got[1]


def _mixed_folder(root):
    """JPEGs of varied sizes plus the decoders' other paths: PNG, grayscale and CMYK JPEG (Pillow decodes CMYK)."""
    make_imagefolder(root, classes=2, per_class=6, size=(30, 40))
    rng = np.random.default_rng(5)
    for name, mode, fmt in (("png.png", "RGB", "PNG"), ("gray.jpg", "L", "JPEG"), ("cmyk.jpg", "CMYK", "JPEG"),
                            ("rgba.png", "RGBA", "PNG")):
        buf = io.BytesIO()
        photo_like(rng, 27, 35, 1).convert(mode).save(buf, format=fmt)
        (root / "class_1" / name).write_bytes(buf.getvalue())
    return root


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return _mixed_folder(tmp_path_factory.mktemp("slots") / "src")


def _worker_batches(ds, start_method="fork", batch_size=5):
    loader = DataLoader(ds, batch_size=batch_size, num_workers=2, collate_fn=list_collate,
                        multiprocessing_context=start_method)
    return [(imgs, labels) for imgs, labels in loader]


@pytest.mark.parametrize("fmt, payload", [("lmdb", "encoded"), ("memmap", "raw"), ("hdf5", "encoded")])
def test_worker_batch_shares_one_block_and_matches_single_reads(tmp_path, mixed, fmt, payload):
    out = convert(mixed, tmp_path / f"ds.{fmt}", to=fmt, payload=payload, workers=0, progress=False).output
    ds = open_dataset(out, image="tensor")
    seen = mixed_batches = 0
    for b, (imgs, labels) in enumerate(_worker_batches(ds)):
        if len({img.shape for img in imgs}) > 1:  # (batches of one shape are left to the collate function)
            blocks = {img.untyped_storage().data_ptr() for img in imgs}
            assert len(blocks) == 1, f"batch {b}: {len(blocks)} blocks"  # crossed as one block
            assert imgs[0].untyped_storage().is_shared()
            mixed_batches += 1
        for k, (img, label) in enumerate(zip(imgs, labels.tolist())):
            ref, ref_label = ds[b * 5 + k]  # main process: no slots
            assert img.shape == ref.shape and img.dtype == torch.uint8 and torch.equal(img, ref) and label == ref_label
            seen += 1
    assert seen == len(ds) and mixed_batches >= len(ds) // 5 - 1


def test_spawned_workers_use_slots_too(spawned):
    """A batch of 8 decoded by a spawned worker (_spawned_slots) crossed as one block."""
    ds = spawned.context
    (imgs, _labels), = spawned.values()
    assert len({img.untyped_storage().data_ptr() for img in imgs}) == 1
    assert all(torch.equal(img, ds[k][0]) for k, img in enumerate(imgs))


@probe_for(test_spawned_workers_use_slots_too)
def _spawned_slots(tmp_path_factory):
    base = tmp_path_factory.mktemp("slots-spawn")
    src = make_imagefolder(base / "src", classes=2, per_class=4)
    ds = open_dataset(convert(src, base / "ds.lmdb", workers=0, progress=False).output, image="tensor")
    return Fetch(ds, [list(range(8))], list_collate), ds


def test_no_slots_outside_workers_with_a_transform_or_unknown_sizes(tmp_path, mixed):
    out = convert(mixed, tmp_path / "ds.lmdb", workers=0, progress=False).output
    plain = open_dataset(out, image="tensor")
    assert plain.pipeline.slots(np.arange(2), WorkerMemory()) is None  # main process: separate tensors
    flipped = open_dataset(out, image="tensor", transform=lambda t: t.flip(-1))
    imgs, _ = _worker_batches(flipped)[0]
    assert len({img.untyped_storage().data_ptr() for img in imgs}) == len(imgs)
    assert torch.equal(imgs[0], open_dataset(out, image="tensor")[0][0].flip(-1))
    blind = convert(mixed, tmp_path / "blind.lmdb", workers=0, progress=False, validate="none").output
    ds = open_dataset(blind, image="tensor")
    assert int(ds.index.heights[0]) == 0  # sizes unknown: decoded one by one, still right
    imgs, _ = _worker_batches(ds)[0]
    assert all(torch.equal(img, ds[k][0]) for k, img in enumerate(imgs))


def test_sizes_from_damaged_metadata_allocate_nothing(tmp_path, mixed):
    """A crafted index size can't make a worker allocate a huge block: no slots, and the per-sample
    path reports the sample."""
    for payload in ("raw", "encoded"):
        out = convert(mixed, tmp_path / f"ds-{payload}.lmdb", payload=payload, workers=0, progress=False).output
        ds = open_dataset(out, image="tensor")
        stored = ds.positions([0, 1]).tolist()  # slots, as the index, work in storage positions
        assert worker_slots(ds, stored) is not None
        ds.index.heights[stored[0]] = 1 << 30
        assert worker_slots(ds, stored) is None
        with pytest.raises(Exception, match="sample 0"):
            ds.__getitems__([0, 1])


def test_batches_of_one_shape_are_left_to_the_collate_function(tmp_path):
    """Equal sizes: default_collate stacks them into shared memory itself, so no block (it would be one more copy)."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=4)
    out = convert(src, tmp_path / "ds.memmap", to="memmap", payload="raw", resize="24x32", workers=0,
                  progress=False).output
    ds = open_dataset(out, image="tensor")
    assert worker_slots(ds, [0, 1, 2]) is None
    (images, labels), = list(DataLoader(ds, batch_size=8, num_workers=2))  # default_collate stacks
    assert images.shape == (8, 3, 24, 32) and torch.equal(images[3], ds[3][0])


def test_no_block_beyond_the_budget(tmp_path, mixed):
    """Sizes nothing has checked yet can't map more than BATCH_BLOCK_MAX for one batch."""
    out = convert(mixed, tmp_path / "ds.lmdb", workers=0, progress=False).output
    ds = open_dataset(out, image="tensor")
    assert worker_slots(ds, [0, 1]) is not None
    assert worker_slots(ds, [0, 1], max_bytes=1000) is None
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ds.__getitems__([0, 1]), (ds[0], ds[1])))


def test_slot_views_are_pieces_of_the_block_and_refuse_one_they_cannot_be():
    """``views`` builds each HWC view with one call at the block's own offset (a pooled block is a slice of a larger
    one); a block that is not contiguous, or too small for the shapes, is refused rather than viewed wrongly."""
    base = torch.arange(200, dtype=torch.int64).to(torch.uint8)
    block = base[17:]  # a storage offset, as a pooled block has
    got = views(block, [(2, 3), (4, 5)])
    assert [tuple(v.shape) for v in got] == [(2, 3, 3), (4, 5, 3)]
    assert torch.equal(got[0].reshape(-1), block[:18]) and torch.equal(got[1].reshape(-1), block[18:78])
    with pytest.raises(ValueError, match="not contiguous or too small"):
        views(base[::2], [(2, 3)])
    with pytest.raises(ValueError, match="not contiguous or too small"):
        views(block, [(10, 10)])
