"""The round-trip contract every registered format meets, for every payload it stores.

One test body per property, parametrized over FORMATS x payloads: adding a format adds its
cases here without a line of test code. Formats that are lossy by design declare
it through ``Format.error_bound`` (largest allowed pixel difference).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from support.imagefolder import ImageFolder
from support.imagesets import make_imagefolder
from support.spawned import Cases, Fetch, batches_of, probe_for
from torch.utils.data import DataLoader

from packer import FORMATS, PackerError, convert, open_dataset
from packer.read.dataset import DATASET_CLASSES, PackedDataset
from packer.read.sampler import BlockShuffleSampler
from packer.tools.verify import verify
from packer.write.options import ConvertOptions
from packer.write.scan import scan_folder
from packer.write.shards import prepare
from packer.write.sources.base import FileReader

# Options a format needs beyond the case's own (e.g. a tile size); none for most.
FORMAT_OPTIONS: dict[str, dict] = {"mosaic": {"tile": "32x48"}}


def cases():
    for name, module in FORMATS.items():
        for payload in sorted(module.payloads - {"none"}):  # images: samples without one, tests/read/test_imageless.py
            yield pytest.param((name, payload, None), id=f"{name}-{payload}")
            if payload == "raw":
                yield pytest.param((name, payload, "24x32"), id=f"{name}-{payload}-24x32")


CASES = list(cases())


@pytest.fixture(scope="module")
def packed_cache(tmp_path_factory):
    return {}


@pytest.fixture(params=CASES)
def packed(request, imagefolder, packed_cache, tmp_path_factory):
    """(dataset path, options) for the case, converted once per module, with shards small enough to split."""
    return packed_case(request.param, imagefolder, packed_cache, tmp_path_factory)


def packed_case(key, imagefolder, packed_cache, tmp_path_factory, workers: int = 2):
    name, payload, resize = key
    if key not in packed_cache:
        out = tmp_path_factory.mktemp("contract") / f"ds.{name}"
        kwargs = dict(FORMAT_OPTIONS.get(name, {}))
        if resize:
            kwargs["resize"] = resize
            kwargs.pop("tile", None)  # mosaic: a fixed --resize HxW is the tile size
        convert(imagefolder, out, to=name, payload=payload, shard_bytes=6_000, workers=workers, progress=False,
                **kwargs)
        packed_cache[key] = out
    return packed_cache[key], name, payload, resize



def _max_error(name: str, options: dict) -> int:
    return int(FORMATS[name].error_bound(options)[1])  # lossy depending on options (mosaic: codec jpeg)


def test_round_trip_bytes_and_pixels(packed, imagefolder):
    path, name, payload, resize = packed
    ds = open_dataset(path, image="numpy")
    scan = scan_folder(imagefolder)
    assert len(ds) == len(scan)
    assert sorted(ds.index.rel_paths()) == sorted(scan.rel_paths)
    for rel, label in zip(scan.rel_paths, scan.labels.tolist()):
        i = ds.index_of(rel)
        img, target = ds[i]
        assert target == label
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3
        source = (imagefolder / rel).read_bytes()
        if payload == "encoded":
            assert bytes(ds.read_payload(i)) == source  # byte-identical
            from packer.images.decode import decode_pil

            assert np.array_equal(img, decode_pil(source))  # exactly what Pillow decodes
        else:
            pil = ConvertOptions.from_record({**ds.manifest.options, "decoder": "pil"})
            ref = prepare(FileReader(imagefolder), rel, label, pil)
            assert img.shape == ref.payload.shape
            diff = np.abs(img.astype(np.int16) - ref.payload.astype(np.int16)).max()
            assert diff <= _max_error(name, ds.manifest.options), f"{rel}: max pixel error {diff}"
            if resize:
                assert img.shape[:2] == (24, 32)


def test_imagefolder_surface(packed, imagefolder):
    path, name, payload, _ = packed
    ds = open_dataset(path)
    scan = scan_folder(imagefolder)
    assert ds.classes == scan.classes and ds.class_to_idx == scan.class_to_idx
    ref = ImageFolder(imagefolder)  # torchvision's rules, re-implemented (support/imagefolder.py)
    assert ds.indexing == "imagefolder" and ds.index.rel_paths() != ds.relpaths  # stored shuffled, read as ImageFolder
    assert ds.samples == ref.samples and ds.targets == ref.targets
    assert [ds[i][1] for i in range(len(ds))] == ref.targets
    s = BlockShuffleSampler(ds, block_bytes=6_000, warn=False)
    assert Counter(s) == Counter(range(len(ref)))
    pil = ConvertOptions.from_record({**ds.manifest.options, "decoder": "pil"})
    for i in (0, 6, len(ref) - 1):  # the image too: ImageFolder's sample i (as converted)
        source, label = ref.samples[i]
        if payload == "encoded":
            assert bytes(ds.read_payload(i)) == open(source, "rb").read()
        else:
            want = prepare(FileReader(imagefolder), ds.relpaths[i], label, pil).payload
            got = np.asarray(open_dataset(path, image="numpy")[i][0])
            assert got.shape == want.shape
            assert np.abs(got.astype(np.int16) - want.astype(np.int16)).max() <= _max_error(name, ds.manifest.options)
    img, _ = ds[0]
    assert img.mode == "RGB"  # image="pil" default, like ImageFolder
    t, _ = open_dataset(path, image="tensor")[0]
    assert t.dtype == torch.uint8 and t.shape[0] == 3
    assert isinstance(ds, DATASET_CLASSES.get(name, PackedDataset))  # a plug-in format's: PackedDataset
    flipped, label = open_dataset(path, transform=lambda im: im.transpose(0), target_transform=lambda y: y + 100)[0]
    assert label == ds.targets[0] + 100 and flipped.size == img.size
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert np.array_equal(np.asarray(ds[-1][0]), np.asarray(ds[len(ds) - 1][0]))


def test_read_copies_equal_read_many_in_memory_of_their_own(packed):
    """``read_copies`` (ThreadLoader's reads: pread, never a map) gives what ``read_many`` gives, shaped alike, into
    the memory given where the format stores plain bytes; and ``payloads_at(into=)`` checks them as other reads."""
    path, *_ = packed
    ds = open_dataset(path, image="numpy")
    for shard, reader in enumerate(ds.store.readers):
        n = ds.manifest.shards[shard].num_samples
        positions = sorted({0, n // 2, n - 1, n // 2})  # ascending, as payloads_at asks
        start = int(ds.store.starts[shard])
        want = reader.read_many(positions)
        size = int(ds.index.nbytes[[start + p for p in positions]].sum())
        for buf in (None, np.zeros(size + 7, np.uint8)):
            got = reader.read_copies(positions, buf)
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert type(g) is type(w) and np.asarray(g).shape == np.asarray(w).shape
                assert np.array_equal(np.asarray(g), np.asarray(w))
    taken = []
    idx = np.arange(len(ds))[::-1]
    got = ds.payloads_at(idx, into=lambda n: taken.append(np.zeros(n, np.uint8)) or taken[-1])
    assert len(taken) == 1 and taken[0].nbytes == int(ds.index.nbytes.sum())
    for g, w in zip(got, ds.payloads_at(idx), strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


def test_shards_split_and_verify(packed):
    path, name, payload, _ = packed
    ds = open_dataset(path)
    shards = ds.manifest.shards
    assert sum(s.num_samples for s in shards) == len(ds)
    assert len(shards) > 1, "a 6 kB shard cap splits 15 small images"
    assert verify(path).ok


def test_getitems_equals_getitem(packed):
    path, *_ = packed
    ds = open_dataset(path, image="numpy")
    order = [3, 4, 5, 0, 14, 7, 7, 13, 12]
    batch = ds.__getitems__(order)
    for i, (img, label) in zip(order, batch):
        ref_img, ref_label = ds[i]
        assert label == ref_label and np.array_equal(img, ref_img)


def digest(img) -> str:
    """Picklable transform (spawn workers import it): identifies a sample by its pixels."""
    return hashlib.sha1(np.ascontiguousarray(img).tobytes()).hexdigest()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_see_every_sample_once(packed, start_method, request):
    path, name, payload, resize = packed
    if start_method == "spawn":  # read by the session's spawned workers (every case at once: _spawned_cases)
        out = request.getfixturevalue("spawned")
        keys, batches = list(out.context), out.values()
        path = out.context[(name, payload, resize)]
        seen = sorted((d, t) for batch in batches for c, d, t in batch if keys[c] == (name, payload, resize))
    ds = open_dataset(path, image="numpy", transform=digest)
    expected = sorted((digest(open_dataset(path, image="numpy")[i][0]), ds.targets[i]) for i in range(len(ds)))
    if start_method != "spawn":
        loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, multiprocessing_context=start_method,
                            generator=torch.Generator().manual_seed(0))
        seen = sorted((d, int(t)) for digests, targets in loader for d, t in zip(digests, targets))
    assert seen == expected


@probe_for(test_dataloader_workers_see_every_sample_once)
def _spawned_cases(tmp_path_factory):
    """Every case read by the spawned workers in shuffled batches of 4 that mix cases: each worker unpickles every
    reader family; each case still checks its own samples. Context: {case: its dataset's path}."""
    imagefolder = make_imagefolder(tmp_path_factory.mktemp("spawned-src") / "imgs")
    cache: dict = {}
    paths = {c.values[0]: packed_case(c.values[0], imagefolder, cache, tmp_path_factory, workers=0)[0] for c in CASES}
    sets = Cases([open_dataset(p, image="numpy", transform=digest) for p in paths.values()])
    order = torch.randperm(len(sets), generator=torch.Generator().manual_seed(0)).tolist()
    return Fetch(sets, batches_of(len(sets), 4, order)), paths


def test_worker_tensors_equal_main_process_reads(packed):
    """Plain tensors from workers (decoded into one shared block per batch) equal single reads."""
    from packer.diagnose.bench import list_collate

    path, *_ = packed
    ds = open_dataset(path, image="tensor")
    batches = [imgs for imgs, _labels in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list_collate)]
    got = [img for imgs in batches for img in imgs]
    assert len(got) == len(ds) and all(torch.equal(img, ds[i][0]) for i, img in enumerate(got))
    for imgs in batches:  # batches of mixed sizes came as one shared block (packer.read.slots)
        if len({img.shape for img in imgs}) > 1:
            assert len({img.untyped_storage().data_ptr() for img in imgs}) == 1


def test_reader_pickles_before_and_after_first_use(packed):
    path, *_ = packed
    ds = open_dataset(path, image="numpy")
    fresh = pickle.loads(pickle.dumps(ds))
    first = ds[1][0]
    used = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(fresh[1][0], first) and np.array_equal(used[1][0], first)


def test_verify_catches_a_flipped_byte(packed, tmp_path):
    import shutil

    path, *_ = packed
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shard = copy / open_dataset(copy).manifest.shards[0].files[0].name
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = verify(copy)
    assert not report.ok and any("checksum" in p for p in report.problems)


def test_wrong_class_refuses_other_formats(packed):
    path, name, *_ = packed
    other = next((cls for fmt, cls in DATASET_CLASSES.items() if fmt != name), None)
    if other is None:
        pytest.skip("only one format registered")
    with pytest.raises(PackerError, match="use packer.open_dataset"):
        other(path)
