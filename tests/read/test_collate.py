"""packer.collate: a default DataLoader over photos of different sizes works, as ImageFolder users expect."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.imagesets import make_imagefolder
from support.spawned import Fetch, batches_of, probe_for
from torch.utils.data import DataLoader, Subset, default_collate

import packer
from packer import PackerError, convert, open_dataset


@pytest.fixture(scope="module")
def mixed_sizes(tmp_path_factory):
    return make_mixed_sizes(tmp_path_factory.mktemp("collate"))


def make_mixed_sizes(root: Path) -> Path:
    """An lmdb dataset of JPEGs in two sizes, so most batches mix shapes."""
    src = make_imagefolder(root / "src", classes=2, per_class=6, size=(30, 40))
    make_imagefolder(root / "src2", classes=2, per_class=6, seed=3, size=(36, 28))
    for f in sorted((root / "src2").rglob("*.jpg")):
        f.rename(src / f.parent.name / f"b_{f.name}")
    return Path(convert(src, root / "ds.lmdb", to="lmdb", workers=0, progress=False).output)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("image", ["tensor", "numpy"])
def test_default_collate_of_mixed_sizes_names_packer_collate(mixed_sizes, workers, image, tmp_path):
    """torch's default collate over photos of several sizes, in DataLoader workers: a PackerError naming the fix
    (torch alone says "Trying to resize storage that is not resizable"); with no workers torch's own clear
    "stack expects each tensor to be equal size"; one size still stacks as before."""
    ds = open_dataset(mixed_sizes, image=image)
    error = (PackerError, r"the images of this batch: \d+ different shapes .*collate_fn=packer\.coll") if workers \
        else (RuntimeError, "stack expects each tensor to be equal size")
    with pytest.raises(error[0], match=error[1]):
        next(iter(DataLoader(ds, batch_size=len(ds), num_workers=workers)))
    one = open_dataset(convert(ds.root, tmp_path / "one.lmdb", payload="raw", resize="16x20", workers=0,
                               progress=False).output, image=image)
    imgs, labels = next(iter(DataLoader(Subset(one, [3, 1, 4, 0]), batch_size=4, num_workers=workers)))
    assert tuple(imgs.shape) == ((4, 3, 16, 20) if image == "tensor" else (4, 16, 20, 3))
    assert labels.tolist() == [one.targets[i] for i in (3, 1, 4, 0)]
    got = next(iter(DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=lambda b: b)))
    assert [type(s) for s in got] == [tuple] * 4  # the mark never reaches other collate functions' output


def test_fields_of_several_shapes_are_named_too(tmp_path):
    with packer.Writer(tmp_path / "b.lmdb", fields={"boxes": "float32[:,4]"}) as w:
        for k in range(4):
            w.add(np.zeros((8, 8, 3), np.uint8), label=0, boxes=np.zeros((k + 1, 4), np.float32))
    ds = open_dataset(tmp_path / "b.lmdb", image="tensor", fields="all")
    with pytest.raises(PackerError, match="field 'boxes' of this batch: 4 different shapes"):
        next(iter(DataLoader(ds, batch_size=4, num_workers=2)))
    batch = next(iter(DataLoader(ds, batch_size=4, collate_fn=packer.collate)))
    assert [b.shape[0] for b in batch["boxes"]] == [1, 2, 3, 4]


def test_default_collate_fails_on_mixed_sizes_and_packer_collate_does_not(mixed_sizes):
    ds = open_dataset(mixed_sizes, image="tensor")
    imgs, labels = next(iter(DataLoader(ds, batch_size=len(ds), collate_fn=packer.collate)))
    assert isinstance(imgs, list) and len(imgs) == len(ds)
    assert labels.dtype == torch.int64 and labels.tolist() == ds.targets
    for i, img in enumerate(imgs):
        assert torch.equal(img, ds[i][0])


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_worker_batches_of_mixed_sizes_cross_as_one_shared_block(request, start_method):
    """With a transform (so no batch slots) each worker batch is still one shared block, not one per image."""
    if start_method == "spawn":  # read by the session's spawned workers (_spawned_mixed)
        ds, batches = request.getfixturevalue("spawned").context, request.getfixturevalue("spawned").values()
    else:
        ds = open_dataset(request.getfixturevalue("mixed_sizes"), image="tensor", transform=torch.clone)
        batches = DataLoader(ds, batch_size=6, num_workers=2, collate_fn=packer.collate,
                             multiprocessing_context=start_method)
    seen, mixed = 0, 0
    for b, (imgs, labels) in enumerate(batches):
        if isinstance(imgs, list):
            mixed += 1
            assert len({img.untyped_storage().data_ptr() for img in imgs}) == 1
            assert imgs[0].untyped_storage().is_shared()
        for k, img in enumerate(imgs):
            ref, label = ds[b * 6 + k]
            assert torch.equal(img, ref) and labels[k].item() == label
            seen += 1
    assert seen == len(ds) and mixed >= 1


@probe_for(test_worker_batches_of_mixed_sizes_cross_as_one_shared_block)
def _spawned_mixed(tmp_path_factory):
    """Batches of 6 of mixed sizes collated by packer.collate in the spawned workers. Context: the dataset."""
    ds = open_dataset(make_mixed_sizes(tmp_path_factory.mktemp("collate")), image="tensor", transform=torch.clone)
    return Fetch(ds, batches_of(len(ds), 6), packer.collate), ds


def test_one_shape_stacks_exactly_as_default_collate():
    rng = np.random.default_rng(0)
    batch = [(torch.from_numpy(rng.integers(0, 255, (3, 8, 8), dtype=np.uint8)), i) for i in range(5)]
    ours, theirs = packer.collate(batch), default_collate(batch)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    arrays = [(t.numpy(), {"label": i, "name": f"n{i}"}) for t, i in batch]
    ours, theirs = packer.collate(arrays), default_collate(arrays)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1]["label"], theirs[1]["label"])
    assert ours[1]["name"] == theirs[1]["name"]


def test_pil_images_and_mixed_arrays_become_lists():
    pil = [(Image.new("RGB", (4 + i, 5)), i) for i in range(3)]
    imgs, labels = packer.collate(pil)
    assert [im.size for im in imgs] == [(4, 5), (5, 5), (6, 5)] and labels.tolist() == [0, 1, 2]
    arrays = [(np.full((2 + i, 3, 3), i, dtype=np.uint8), i) for i in range(3)]
    arrays[1][0].flags.writeable = False  # raw payloads are read-only views
    imgs, labels = packer.collate(arrays)
    assert [tuple(t.shape) for t in imgs] == [(2, 3, 3), (3, 3, 3), (4, 3, 3)]
    assert all(isinstance(t, torch.Tensor) and int(t[0, 0, 0]) == i for i, t in enumerate(imgs))
