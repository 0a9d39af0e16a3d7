"""The attributes other libraries read: torchvision's DatasetFolder/VisionDataset surface, timm's
``ImageDataset.filename(s)``, sampler reprs and the context manager, on PackedDataset and CachedDataset."""

from __future__ import annotations

import numpy as np
import pytest
from support._tiny import mapped_files
from support.imagefolder import IMG_EXTENSIONS, ImageFolder, default_loader, find_classes

from packer import open_dataset
from packer.read.sampler import BlockBatchSampler, BlockShuffleSampler


@pytest.fixture(params=["plain", "ram"])
def opened(request, imagefolder, tmp_path_factory):
    from packer import convert

    out = tmp_path_factory.mktemp("surface") / "ds.lmdb"
    convert(imagefolder, out, workers=0, progress=False)
    cache = None if request.param == "plain" else "ram"
    ds = open_dataset(out, cache=cache, cache_options={"progress": False})
    yield ds, out
    ds.close()


def test_datasetfolder_attributes(opened, imagefolder):
    ds, out = opened
    ref = ImageFolder(imagefolder)
    assert ds.find_classes(imagefolder) == find_classes(str(imagefolder)) == ds.find_classes()
    path = ds.samples[4][0]
    assert ds.loader(path).mode == "RGB"
    assert np.array_equal(np.asarray(ds.loader(path)), np.asarray(default_loader(path)))
    assert ds.extensions == IMG_EXTENSIONS
    assert ds.root == out.absolute() and ds.source_root == str(imagefolder)  # root: the packed dataset (documented)
    assert [t for _, t in ds.samples] == ds.targets == ref.targets


def test_visiondataset_transforms(opened):
    ds, _ = opened
    assert ds.transforms is None
    ds.transform, ds.target_transform = (lambda im: im.size), (lambda y: y + 10)
    try:
        joint = ds.transforms
        assert type(joint).__name__ == "StandardTransform"
        img, label = ds[2]
        raw = open_dataset(ds.root)[2]
        assert joint(raw[0], raw[1]) == (img, label) == (raw[0].size, raw[1] + 10)
        assert "Transform:" in repr(joint) and "Target transform:" in repr(joint)
    finally:
        ds.transform = ds.target_transform = None


def test_timm_filename_and_filenames(opened, imagefolder):
    ds, _ = opened
    ref = ImageFolder(imagefolder)
    for kwargs in ({}, {"basename": True}, {"absolute": True}, {"basename": True, "absolute": True}):
        assert ds.filenames(**kwargs) == [ref.timm_filename(i, **kwargs) for i in range(len(ref))], kwargs
        assert ds.filename(7, **kwargs) == ref.timm_filename(7, **kwargs)
    assert ds.filename(-1) == ref.timm_filename(len(ref) - 1)


def test_context_manager_closes_the_shards(imagefolder, tmp_path):
    from packer import convert

    out = convert(imagefolder, tmp_path / "ctx.lmdb", workers=0, progress=False).output
    with open_dataset(out) as ds:
        ds[0]
        assert mapped_files(str(out))
    assert not mapped_files(str(out))
    with open_dataset(out, cache="ram", cache_options={"progress": False}) as cached:
        cache_file = cached.path
        assert cache_file.exists()
    assert not cache_file.exists()


def test_sampler_reprs(imagefolder, tmp_path):
    from packer import convert

    ds = open_dataset(convert(imagefolder, tmp_path / "r.lmdb", workers=0, progress=False).output)
    s = BlockShuffleSampler(ds, block_bytes=5_000, batch_size=4, seed=3, warn=False)
    text = repr(s)
    for part in ("BlockShuffleSampler(", "samples=15", f"blocks={s.num_blocks}", "batch_size=4", "seed=3",
                 "num_replicas=1", "rank=0", "drop_last=False", "epoch=0"):
        assert part in text, text
    b = repr(BlockBatchSampler(ds, 4, seed=3, warn=False))
    assert b.startswith("BlockBatchSampler(batch_size=4, drop_last_batch=False, sampler=BlockShuffleSampler(")
