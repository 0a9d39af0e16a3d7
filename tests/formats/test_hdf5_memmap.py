"""HDF5 and numpy memmap formats: what is specific to them (the shared round trip is test_contract.py).

The files must make sense without packer (plain numpy, plain h5py), resize must produce the
documented shapes, --compression must be refused where it can't apply, a conversion that
lacks disk space must write nothing, a full disk mid-write must end in packer's error, and
whole batches must come back right, in and out of DataLoader workers. (Round trips, labels,
shards, fork/spawn workers and pickling for every format and payload: test_contract.py.)
"""

from __future__ import annotations

import gc
import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from PIL import Image
from support.spawned import Fetch, batches_of, probe_for
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, default_convert

from packer import PackerError, convert, open_dataset
from packer.cli import main as cli_main
from packer.formats import hdf5
from packer.formats.hdf5 import writer as hdf5_writer
from packer.images.resize import ResizeSpec
from packer.tools.sample import photo_like

FORMATS3 = ("hdf5", "memmap")
# (height, width) of the sources: landscape, portrait, square, one smaller than every resize target
SIZES = [(60, 80), (80, 56), (64, 64), (20, 30), (72, 96), (50, 70)]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_src(tmp_path_factory.mktemp("src") / "imgs")


def make_src(root: Path) -> Path:
    """3 classes of small photo-like JPEGs (mixed shapes), one RGBA PNG, one truncated JPEG."""
    rng = np.random.default_rng(3)
    n = 0
    for c in range(3):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True)
        for k in range(4):
            h, w = SIZES[(c * 4 + k) % len(SIZES)]
            img = photo_like(rng, max(h, 48), max(w, 48), c).resize((w, h))
            img.save(folder / f"img_{n:03d}.jpg", quality=90)
            n += 1
    rgba = np.dstack([np.asarray(photo_like(rng, 52, 66, 1)), np.full((52, 66), 200, np.uint8)])
    Image.fromarray(rgba, "RGBA").save(root / "class_1" / "alpha.png")
    good = (root / "class_0" / "img_000.jpg").read_bytes()
    (root / "class_2" / "broken.jpg").write_bytes(good[: len(good) // 2])  # fails validation
    return root


def pillow(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def packed_sources(ds) -> list[Path]:
    return [Path(ds.manifest.source) / p for p in ds.index.rel_paths()]


def pack(src: Path, tmp_path: Path, fmt: str, payload: str = "encoded", **kw):
    out = tmp_path / f"out.{fmt}"
    # stored in ImageFolder's order: the files' own arrays (read with h5py/numpy) line up with ds[i]
    res = convert(src, out, to=fmt, payload=payload, workers=0, progress=False, **{"order": "source", **kw})
    assert [e.path for e in res.errors] == ["class_2/broken.jpg"]  # every writer got one sample fewer than planned
    return open_dataset(out, image="numpy")


def expected_pixels(path: Path, resize: str | None = None, mode: str = "stretch", upscale: bool = False) -> np.ndarray:
    spec = ResizeSpec.parse(resize, mode, upscale)
    px = pillow(path)
    return px if spec is None else spec.apply(px)


# ---------------------------------------------------------------- memmap files, read with plain numpy


def test_memmap_fixed_shape_is_one_plain_npy(src, tmp_path):
    ds = pack(src, tmp_path, "memmap", "raw", resize="32x48")
    files = [f.name for s in ds.manifest.shards for f in s.files]
    assert files == ["shard-00000.pixels.npy"]
    arr = np.load(ds.root / files[0], mmap_mode="r")  # anyone with numpy, no packer
    assert arr.shape == (len(ds), 32, 48, 3) and arr.dtype == np.uint8 and len(ds) == 13
    for i, path in enumerate(packed_sources(ds)):
        assert np.array_equal(arr[i], expected_pixels(path, "32x48"))
        assert np.array_equal(ds[i][0], arr[i])
    # the header was rewritten for 13 samples (14 planned): np.load without mmap agrees too
    assert np.load(ds.root / files[0]).shape[0] == 13


def test_memmap_mixed_and_encoded_are_flat_files_with_npy_index(src, tmp_path):
    raw = pack(src, tmp_path / "raw", "memmap", "raw")
    blob = np.fromfile(raw.root / "shard-00000.pixels.bin", dtype=np.uint8)
    offsets = np.load(raw.root / "shard-00000.offsets.npy", allow_pickle=False)
    shapes = np.load(raw.root / "shard-00000.shapes.npy", allow_pickle=False)
    assert offsets.dtype == np.dtype("<i8") and shapes.dtype == np.dtype("<i8") and shapes.shape == (len(raw), 3)
    for i, path in enumerate(packed_sources(raw)):
        assert np.array_equal(blob[offsets[i] : offsets[i + 1]].reshape(shapes[i]), pillow(path))

    enc = pack(src, tmp_path / "enc", "memmap")
    data = (enc.root / "shard-00000.files.bin").read_bytes()
    offsets = np.load(enc.root / "shard-00000.offsets.npy", allow_pickle=False)
    sources = packed_sources(enc)
    assert len(data) == sum(p.stat().st_size for p in sources)  # nothing but the files' bytes
    for i, path in enumerate(sources):
        assert data[offsets[i] : offsets[i + 1]] == path.read_bytes()
        assert enc.read_payload(i) == path.read_bytes()


def test_memmap_views_are_read_only_and_tensors_are_copies(src, tmp_path):
    ds = pack(src, tmp_path, "memmap", "raw", resize="32x48")
    view = ds.read_payload(0)
    assert not view.flags.writeable and not view.flags.owndata  # zero-copy view of the map
    t = open_dataset(ds.root, image="tensor")[0][0]
    assert t.shape == (3, 32, 48)
    t[:] = 0  # a private copy: the dataset is unchanged
    assert np.array_equal(ds[0][0], expected_pixels(packed_sources(ds)[0], "32x48"))


# ---------------------------------------------------------------- HDF5 files, read with plain h5py


def test_hdf5_encoded_has_documented_datasets(src, tmp_path):
    ds = pack(src, tmp_path, "hdf5")
    with h5py.File(ds.root / "shard-00000.h5", "r") as f:
        assert set(f) == {"images", "offsets", "labels"}
        images, offsets, labels = f["images"], f["offsets"][()], f["labels"][()]
        assert images.dtype == np.uint8 and images.ndim == 1 and h5py.check_vlen_dtype(images.dtype) is None
        assert images.chunks is not None and offsets.dtype == np.dtype("<i8") and labels.dtype == np.dtype("<i8")
        assert f.attrs["packer_format"] == "hdf5" and f.attrs["payload"] == "encoded"
        assert f.attrs["layout"] == "blob" and f.attrs["num_samples"] == len(ds) == 13
        assert all("description" in f[name].attrs for name in f)
        for i, path in enumerate(packed_sources(ds)):
            assert images[offsets[i] : offsets[i + 1]].tobytes() == path.read_bytes()
        assert labels.tolist() == ds.targets


def test_hdf5_raw_fixed_is_n_h_w_3_one_image_per_chunk(src, tmp_path):
    ds = pack(src, tmp_path, "hdf5", "raw", resize="40x40", resize_mode="fit")
    with h5py.File(ds.root / "shard-00000.h5", "r") as f:
        assert set(f) == {"images", "labels"} and f.attrs["layout"] == "fixed"
        images = f["images"]
        assert images.shape == (13, 40, 40, 3) and images.chunks == (1, 40, 40, 3) and images.compression is None
        for i, path in enumerate(packed_sources(ds)):
            assert np.array_equal(images[i], expected_pixels(path, "40x40", "fit"))


def test_hdf5_raw_mixed_shapes_has_shapes_dataset(src, tmp_path):
    ds = pack(src, tmp_path, "hdf5", "raw", resize="24")
    with h5py.File(ds.root / "shard-00000.h5", "r") as f:
        assert set(f) == {"images", "offsets", "shapes", "labels"}
        images, offsets, shapes = f["images"], f["offsets"][()], f["shapes"][()]
        for i, path in enumerate(packed_sources(ds)):
            want = expected_pixels(path, "24")
            assert tuple(shapes[i]) == want.shape
            assert np.array_equal(images[offsets[i] : offsets[i + 1]].reshape(shapes[i]), want)
            assert np.array_equal(ds[i][0], want)


@pytest.mark.parametrize("codec", ["lzf", "gzip"])
def test_hdf5_compression_raw(src, tmp_path, codec):
    ds = pack(src, tmp_path, "hdf5", "raw", resize="32x32", compression=codec)
    assert ds.manifest.options["compression"] == codec
    assert ds.manifest.shards[0].facts["compression"] == codec
    with h5py.File(ds.root / "shard-00000.h5", "r") as f:
        assert f["images"].compression == codec
    for i, path in enumerate(packed_sources(ds)):
        assert np.array_equal(ds[i][0], expected_pixels(path, "32x32"))
    plain = pack(src, tmp_path / "plain", "hdf5", "raw", resize="32x32")
    assert (ds.root / "shard-00000.h5").stat().st_size < (plain.root / "shard-00000.h5").stat().st_size


@pytest.mark.parametrize(("fmt", "payload", "needle"), [
    ("hdf5", "encoded", "raw payloads only"),
    ("memmap", "raw", "offers no compression"),
    ("lmdb", "raw", "offers no compression"),
])
def test_compression_refused_clearly(src, tmp_path, fmt, payload, needle, capsys):
    with pytest.raises(PackerError, match=needle):
        convert(src, tmp_path / "x", to=fmt, payload=payload, compression="gzip", progress=False)
    assert not list(tmp_path.iterdir())
    assert cli_main(["convert", str(src), "--to", fmt, "--payload", payload, "--compression", "lzf",
                     "-o", str(tmp_path / "y"), "-q"]) == 2
    assert needle in capsys.readouterr().err


# ---------------------------------------------------------------- resize shapes through convert()


@pytest.mark.parametrize("fmt", FORMATS3)
def test_resize_short_side_keeps_aspect_and_never_upscales(src, tmp_path, fmt):
    ds = pack(src, tmp_path, fmt, "raw", resize="40")
    assert ds.manifest.options["resize"] == "40"
    for i, path in enumerate(packed_sources(ds)):
        h0, w0 = pillow(path).shape[:2]
        h, w = ds[i][0].shape[:2]
        if min(h0, w0) <= 40:
            assert (h, w) == (h0, w0)  # small image left alone
        else:
            assert min(h, w) == 40 and abs(w / h - w0 / h0) < 0.05
        assert (h, w) == (ds.index.heights[i], ds.index.widths[i])
    up = pack(src, tmp_path / "up", fmt, "raw", resize="40", upscale=True)
    assert all(min(up[i][0].shape[:2]) == 40 for i in range(len(up)))


@pytest.mark.parametrize("fmt", FORMATS3)
def test_resize_hxw_stretch_and_fit(src, tmp_path, fmt):
    stretch = pack(src, tmp_path / "s", fmt, "raw", resize="30x36")
    fit = pack(src, tmp_path / "f", fmt, "raw", resize="30x36", resize_mode="fit")
    for ds in (stretch, fit):
        assert ds.fixed_shape == (30, 36, 3)
        assert set(zip(ds.index.heights.tolist(), ds.index.widths.tolist(), strict=True)) == {(30, 36)}
    for i, path in enumerate(packed_sources(fit)):
        h0, w0 = pillow(path).shape[:2]
        img = fit[i][0]
        rows, cols = np.nonzero(img.max(axis=2) > 0)
        if h0 / w0 > 30 / 36 and h0 > 30:  # portrait: fills the height, black bars left and right
            assert rows.min() == 0 and rows.max() == 29 and (cols.min() > 0 or cols.max() < 35)
        assert np.array_equal(img, expected_pixels(path, "30x36", "fit"))
    small = [i for i, p in enumerate(packed_sources(stretch)) if pillow(p).shape[:2] == (20, 30)]
    assert small, "the fixture has a 20x30 image"
    img = stretch[small[0]][0]  # smaller than 30x36 and no --upscale: centred, padded, not enlarged
    assert np.array_equal(img[5:25, 3:33], pillow(packed_sources(stretch)[small[0]]))
    assert not img[:5].any() and not img[25:].any()


# ---------------------------------------------------------------- free space, nothing written


@pytest.mark.parametrize("fmt", FORMATS3)
def test_refuses_without_disk_space_and_writes_nothing(src, tmp_path, fmt, monkeypatch):
    from packer.write.options import ConvertOptions
    from packer.write.plan import estimate_sample_bytes
    from packer.write.scan import scan_folder

    scan = scan_folder(src)
    need = {p: len(scan) * estimate_sample_bytes(scan, ConvertOptions(format=fmt, payload=p))
            for p in ("raw", "encoded")}
    free = int((need["raw"] + need["encoded"]) / 2)  # room for the JPEGs, not for their pixels
    assert need["encoded"] * 1.1 < free < need["raw"]
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=free))
    out = tmp_path / "out"
    with pytest.raises(PackerError, match="not enough free disk space"):
        convert(src, out, to=fmt, payload="raw", progress=False, workers=0)
    assert list(tmp_path.iterdir()) == []
    convert(src, out, to=fmt, payload="encoded", progress=False, workers=0)
    assert (out / "manifest.json").is_file()


# ---------------------------------------------------------------- readers: pickling, batches, damage


@pytest.mark.parametrize("fmt", FORMATS3)
def test_same_bytes_whatever_the_worker_count_and_access(src, tmp_path, fmt):
    ds = pack(src, tmp_path / "a", fmt, "raw", resize="32")
    again = convert(src, tmp_path / "b", to=fmt, payload="raw", resize="32", workers=2, progress=False, order="source")
    sums = [[f.sha256 for s in open_dataset(p).manifest.shards for f in s.files] for p in (ds.root, again.output)]
    assert sums[0] == sums[1]  # no timestamps or worker-dependent order inside the files
    rnd = open_dataset(ds.root, image="numpy", access="random")  # read-ahead off: same samples
    assert all(np.array_equal(rnd[i][0], ds[i][0]) for i in range(len(ds)))


@pytest.mark.parametrize("fmt", FORMATS3)
def test_get_batch_matches_per_sample_reads_across_shards(src, tmp_path, fmt):
    ds = pack(src, tmp_path, fmt, "raw", resize="24x32", shard_bytes=5 * 24 * 32 * 3)
    assert len(ds.manifest.shards) >= 3 and ds.fixed_shape == (24, 32, 3)
    idx = [12, 0, 5, 6, 7, 3, 11]
    images, labels = ds.get_batch(idx)
    assert images.shape == (7, 24, 32, 3) and images.dtype == torch.uint8
    assert np.array_equal(images.numpy(), np.stack([ds[i][0] for i in idx]))
    assert labels.tolist() == [ds.targets[i] for i in idx]
    nchw, sorted_labels = ds.get_batch(idx, layout="NCHW", sort=True)
    assert nchw.shape == (7, 3, 24, 32) and nchw.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(nchw.permute(0, 2, 3, 1).numpy(), np.stack([ds[i][0] for i in sorted(idx)]))
    assert sorted_labels.tolist() == [ds.targets[i] for i in sorted(idx)]
    out = torch.empty((7, 24, 32, 3), dtype=torch.uint8)
    assert ds.get_batch(idx, out=out)[0].data_ptr() == out.data_ptr()


def test_get_batch_refuses_mixed_shapes(src, tmp_path):
    ds = pack(src, tmp_path, "memmap", "raw")
    assert ds.fixed_shape is None
    with pytest.raises(PackerError, match="one shape"):
        ds.get_batch([0, 1, 2])


def test_damaged_files_give_packer_errors(src, tmp_path):
    mm = pack(src, tmp_path / "m", "memmap")
    with open(mm.root / "shard-00000.files.bin", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(PackerError, match="offsets|manifest says"):  # the size check on open sees it first
        open_dataset(mm.root)[0]
    h5 = pack(src, tmp_path / "h", "hdf5", "raw", resize="16x16")
    (h5.root / "shard-00000.h5").write_bytes(b"not an HDF5 file")
    with pytest.raises(PackerError, match="shard-00000.h5"):
        open_dataset(h5.root)[0]
    npy = pack(src, tmp_path / "n", "memmap", "raw", resize="16x16")
    with open(npy.root / "shard-00000.pixels.npy", "r+b") as fh:
        fh.truncate(5000)
    with pytest.raises(PackerError, match="bytes"):
        open_dataset(npy.root)[0]
    # a crafted manifest on intact files (damaged files are refused earlier, by size): layout facts make no sense
    for ds in (pack(src, tmp_path / "m2", "memmap"), pack(src, tmp_path / "h2", "hdf5", "raw", resize="16x16")):
        manifest = json.loads((ds.root / "manifest.json").read_text())
        manifest["shards"][0]["facts"] = {"layout": "fixed", "shape": [16, -1, 3]}
        (ds.root / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(PackerError, match="layout"):
            open_dataset(ds.root)


# ---------------------------------------------------------------- DataLoader workers, fork and spawn


@pytest.mark.parametrize(("fmt", "method"), [("hdf5", "fork"), ("memmap", "spawn")])
def test_batched_loader_reads_every_sample_once(request, tmp_path, fmt, method):
    sampler = BatchSampler(SequentialSampler(range(13)), batch_size=4, drop_last=False)
    if method == "spawn":  # read by the session's spawned workers (_spawned_batched)
        ds, got = request.getfixturevalue("spawned").context, request.getfixturevalue("spawned").values()
    else:
        ds = pack(request.getfixturevalue("src"), tmp_path, fmt, "raw", resize="16x20")
        got = DataLoader(ds.batched(layout="NCHW"), sampler=sampler, batch_size=None, num_workers=2,
                         multiprocessing_context=method)
    images, labels = zip(*got, strict=True)
    assert len(ds) == 13 and [tuple(x.shape[1:]) for x in images] == [(3, 16, 20)] * len(images)
    allimg = torch.cat(images).permute(0, 2, 3, 1).numpy()
    assert np.array_equal(allimg, np.stack([ds[i][0] for i in range(len(ds))]))
    assert torch.cat(labels).tolist() == ds.targets


@probe_for(test_batched_loader_reads_every_sample_once)
def _spawned_batched(tmp_path_factory):
    """Batches of 4 of a memmap through ``batched(layout="NCHW")``, as a DataLoader with batch_size=None and a
    batch sampler fetches them. Context: the dataset."""
    base = tmp_path_factory.mktemp("memmap")
    ds = pack(make_src(base / "imgs"), base, "memmap", "raw", resize="16x20")
    return Fetch(ds.batched(layout="NCHW"), batches_of(len(ds), 4), default_convert, batched=False), ds


def test_cli_convert_and_info(src, tmp_path, capsys):
    out = tmp_path / "cli.memmap"
    assert cli_main(["convert", str(src), "--to", "memmap", "--payload", "raw", "--resize", "24x24",
                     "-o", str(out), "-q"]) == 1  # 1: one file (broken.jpg) not packed
    capsys.readouterr()
    assert cli_main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "memmap" and info["num_samples"] == 13 and info["shards"][0]["facts"]["layout"] == "fixed"
    assert np.load(out / "shard-00000.pixels.npy", mmap_mode="r").shape == (13, 24, 24, 3)


@pytest.mark.parametrize(("planned", "written"), [(10, 9), (100, 0), (100_000, 7)])
def test_writers_close_with_fewer_samples_than_planned(tmp_path, planned, written):
    """Validation drops samples after the shard was planned: the files describe only what was written."""
    from packer.formats import memmap
    from packer.formats.base import PreparedSample

    for module in (memmap, hdf5):
        w = module.Writer(tmp_path, planned, planned, "raw", {"resize": "4x5"})
        for k in range(written):
            w.add(PreparedSample(k, f"x{k}.jpg", k % 3, np.full((4, 5, 3), k, np.uint8), 4, 5))
        names, facts = w.close()
        assert facts["layout"] == "fixed"
        if module is memmap:
            arr = np.load(tmp_path / names[0])  # numpy's own reader agrees with the rewritten header
            assert (tmp_path / names[0]).stat().st_size == 128 + written * 60
        else:
            with h5py.File(tmp_path / names[0], "r") as f:
                arr = f["images"][()]
                assert f["labels"][()].tolist() == [k % 3 for k in range(written)]
                assert f.attrs["num_samples"] == written
        assert arr.shape == (written, 4, 5, 3)
        assert [int(a[0, 0, 0]) for a in arr] == list(range(written))


@pytest.mark.parametrize(("fmt", "kw", "size"), [
    ("hdf5", {"payload": "raw"}, "96k"),  # ~170 KB of pixels
    ("hdf5", {"payload": "raw", "resize": "40x40", "compression": "gzip"}, "16k"),
    ("hdf5", {}, "16k"),  # ~45 KB of JPEGs
    ("memmap", {"payload": "raw"}, "96k"),
    ("memmap", {"payload": "raw", "resize": "40x40"}, "32k"),  # the fixed-shape .npy
])
def test_disk_full_mid_write_is_a_clear_resumable_error(src, tmp_path, fmt, kw, size):
    """A real ENOSPC (small tmpfs) while writing: packer's error naming the output, no crash, nothing complete.

    (HDF5 that fails inside close() leaves h5py objects that crash the interpreter when
    collected; memmap written through a writable map would die of SIGBUS.)
    """
    import subprocess
    from unittest import mock

    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(small)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs root and tmpfs to make a small filesystem")
    try:
        with mock.patch("packer.write.plan.check_free_space"), pytest.raises(PackerError) as err:
            convert(src, small / "o", to=fmt, workers=0, progress=False, **kw)
        gc.collect()  # what would crash, crashes now
        msg = str(err.value)
        assert str(small / "o") in msg and ("space" in msg.lower() or "full" in msg.lower())
        assert not (small / "o").exists()
        assert not list(small.glob("**/manifest.json"))
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.mark.parametrize("options", [{}, {"payload": "raw", "resize": "20"}, {"payload": "raw", "resize": "32x48"}],
                         ids=["encoded", "raw-mixed", "raw-fixed"])
def test_uncompressed_hdf5_reads_are_views_of_the_mapped_file(src, tmp_path, options, monkeypatch):
    """Samples within one chunk are zero-copy views of the shard's map; one across a chunk boundary too where its
    chunks follow each other in the file (as h5py writes them), else it is joined (a read-only copy)."""
    monkeypatch.setattr(hdf5_writer, "BLOB_CHUNK", 4096)  # small chunks: many samples cross a boundary
    ds = pack(src, tmp_path, "hdf5", **options)
    reader = ds.store.readers[0]
    h = reader._get()
    with h5py.File(ds.root / "shard-00000.h5", "r", locking=False) as f:  # the flags packer opened it with
        fixed = "offsets" not in f
        o = None if fixed else f["offsets"][()]
        wants = [f["images"][i] if fixed else f["images"][o[i] : o[i + 1]] for i in range(len(ds))]
    crossing, apart = 0, 0
    for i, (got, alone) in enumerate(zip(reader.read_many(list(range(len(ds)))), map(reader.read, range(len(ds))))):
        for arr in map(np.asarray, (got, alone)):  # a batch's and a single read's
            assert arr.size and np.array_equal(arr.reshape(-1), wants[i].reshape(-1))
            assert not arr.flags.writeable
            chunks = [] if h.offsets is None else list(range(int(h.offsets[i]) // 4096,
                                                             (int(h.offsets[i + 1]) - 1) // 4096 + 1))
            adjacent = all(h.mapped.chunk(c) + 4096 == h.mapped.chunk(c + 1) for c in chunks[:-1])
            assert np.shares_memory(arr, h.mapped.data) == adjacent  # else joined
        crossing += len(chunks) > 1
        apart += not adjacent
    assert (crossing > apart) == (not fixed)  # most samples across chunks are views


@pytest.mark.parametrize("options", [{}, {"payload": "raw", "resize": "20"}, {"payload": "raw", "resize": "32x48"}],
                         ids=["encoded", "raw-mixed", "raw-fixed"])
def test_hdf5_batch_ranges_equal_each_samples_spans(src, tmp_path, options, monkeypatch):
    """``MappedChunks.sample_ranges`` (a batch at once: read-ahead, the page-cache question) gives each sample its
    pieces, chunk by chunk as the test finds them (joined where a chunk follows the one before it in the file),
    across chunk boundaries, in any order, repeats included; an empty range none."""
    monkeypatch.setattr(hdf5_writer, "BLOB_CHUNK", 4096)  # small chunks: many samples cross a boundary
    ds = pack(src, tmp_path, "hdf5", **options)
    h = ds.store.readers[0]._get()
    m = h.mapped

    def pieces(a: int, b: int) -> list[tuple[int, int]]:
        size, out = m.chunk_bytes, []
        for c in range(a // size, -(-b // size)):
            start = m.chunk(c) + max(a, c * size) - c * size
            stop = start + min(b, (c + 1) * size) - max(a, c * size)
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        return out

    def alone(p: int) -> list[tuple[str, int, int]]:
        a, b = (p * m.chunk_bytes, (p + 1) * m.chunk_bytes) if h.offsets is None else (h.offsets[p], h.offsets[p + 1])
        return [(str(m.path), start, stop) for start, stop in pieces(int(a), int(b))]

    rng = np.random.default_rng(0)
    for size in (0, 1, 5, len(ds), 3 * len(ds)):
        positions = rng.integers(0, len(ds), size).tolist()
        assert m.file_spans(positions, h.offsets) == [alone(p) for p in positions]
    starts, ends, owners = m._file_ranges(np.array([7, 100]), np.array([7, 5000]))  # the first is empty
    assert list(zip(starts.tolist(), ends.tolist())) == pieces(100, 5000) and set(owners.tolist()) == {1}
    assert int((ends - starts).sum()) == 4900


def test_hdf5_samples_across_chunks_apart_in_the_file_are_joined(tmp_path):
    """Where a sample's chunks do not follow each other in the file (written here out of order), it is read as a
    read-only joined copy, one range per chunk, in a batch and alone; page-cache answers cover every piece."""
    from packer.formats.hdf5.chunks import MappedChunks

    path, size = tmp_path / "apart.h5", 4096
    data = np.random.default_rng(0).integers(0, 256, 3 * size, dtype=np.uint8)
    with h5py.File(path, "w") as f:
        dset = f.create_dataset("images", shape=(3 * size,), dtype="u1", chunks=(size,))
        for c in (1, 0, 2):  # chunk 1 first: chunks 0, 1 and 2 lie as 1, 0, 2 in the file
            dset[c * size:(c + 1) * size] = data[c * size:(c + 1) * size]
    with h5py.File(path, "r") as f:
        m = MappedChunks(path, f["images"], f.id.get_vfd_handle(), path.stat().st_size, "sequential")
        assert m.chunk(0) + size != m.chunk(1) and m.chunk(1) + size != m.chunk(2)
        offsets = np.array([0, 4000, 4200, 3 * size])  # sample 1 across chunks 0 and 1, sample 2 across 1 and 2
        for got in (m.samples([0, 1, 2], offsets), [m.flat(int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]):
            for k, arr in enumerate(got):
                assert np.array_equal(arr, data[offsets[k]:offsets[k + 1]]) and not arr.flags.writeable
            assert np.shares_memory(got[0], m.data) and not np.shares_memory(got[1], m.data)
        assert [len(s) for s in m.file_spans([0, 1, 2], offsets)] == [1, 2, 2]
        assert m.cached([0, 1, 2], offsets).all()  # just written
        m.close()


def test_hdf5_mapped_chunks_go_with_their_reader_without_the_garbage_collector(src, tmp_path):
    """The page-cache question refers back to the mapped chunks weakly: no reference cycle keeps the data's map
    alive after ``close`` (its pages mapped, they could not be evicted, nor the map's memory given back)."""
    import weakref

    ds = pack(src, tmp_path, "hdf5")
    reader = ds.store.readers[0]
    assert reader.cached([0, 1]).all()  # just written: cached, the whole file asked about, holding ranges made
    ref = weakref.ref(reader._get().mapped)
    assert ref()._residency._mask is not None
    gc.disable()
    try:
        ds.close()
        assert ref() is None
    finally:
        gc.enable()


def test_hdf5_a_chunk_not_stored_fails_only_the_samples_in_it(src, tmp_path, monkeypatch):
    """A shard with one /images chunk never written (damaged or crafted, padded to its recorded size): the other
    samples read and are asked about as before; one in that chunk is refused, naming the chunk."""
    monkeypatch.setattr(hdf5_writer, "BLOB_CHUNK", 4096)
    ds = pack(src, tmp_path, "hdf5")
    shard = ds.root / "shard-00000.h5"
    size, want = shard.stat().st_size, [bytes(p) for p in ds.read_payloads(range(len(ds)))]
    ds.close()
    with h5py.File(shard, "r") as f:
        parts = {name: (f[name][()], dict(f[name].attrs)) for name in f}
        attrs, offsets = dict(f.attrs), f["offsets"][()]
    with h5py.File(shard, "w", libver=hdf5_writer._LIBVER) as f:
        f.attrs.update(attrs)
        for name, (data, dattrs) in parts.items():
            if name == "images":
                dset = f.create_dataset(name, shape=data.shape, maxshape=(None,), dtype="u1", chunks=(4096,))
                for c in range(-(-len(data) // 4096)):
                    if c != 2:  # chunk 2 never written
                        dset[c * 4096:(c + 1) * 4096] = data[c * 4096:(c + 1) * 4096]
            else:
                dset = f.create_dataset(name, data=data)
            dset.attrs.update(dattrs)
    assert shard.stat().st_size <= size
    os.truncate(shard, size)
    ds = open_dataset(ds.root, image="numpy")
    hit = [i for i in range(len(ds)) if offsets[i] // 4096 <= 2 <= (offsets[i + 1] - 1) // 4096]
    others = [i for i in range(len(ds)) if i not in hit]
    assert hit and others
    assert ds.store.readers[0].cached(others).all()  # just written: cached
    assert [bytes(p) for p in ds.read_payloads(others)] == [want[i] for i in others]
    with pytest.raises(PackerError, match="chunk 2 is"):
        ds.read_payload(hit[0])


def test_hdf5_chunks_are_found_in_one_pass_of_the_index(tmp_path, monkeypatch):
    """Every chunk's offset comes from one pass over HDF5's chunk index (looked up one by one, a chunk far into a
    50,000-chunk shard cost 2 ms): reading and asking the page cache look none up by coordinate, and the offsets
    are those the coordinates give. A shard of more chunks has a few looked up one by one first."""
    from packer.formats.hdf5 import chunks as hdf5_chunks
    from packer.formats.hdf5.chunks import MappedChunks

    path = tmp_path / "fixed.h5"
    with h5py.File(path, "w", libver=hdf5_writer._LIBVER) as f:  # as the writer makes a fixed-shape shard
        dset = f.create_dataset("images", shape=(3000, 4, 4, 3), maxshape=(None, 4, 4, 3), dtype="u1",
                                chunks=(1, 4, 4, 3))
        dset[...] = np.random.default_rng(0).integers(0, 256, dset.shape, dtype=np.uint8)
        want = dset[()]

    class Counting:  # the dataset, with lookups by coordinate counted
        def __init__(self, dset):
            self.dset, self.lookups = dset, 0
            outer = self

            class Id:
                def get_chunk_info_by_coord(self, coord):
                    outer.lookups += 1
                    return dset.id.get_chunk_info_by_coord(coord)

                def chunk_iter(self, callback):
                    return dset.id.chunk_iter(callback)

            self.id = Id()

        def __getattr__(self, name):
            return getattr(self.dset, name)

    with h5py.File(path, "r") as f:
        counted = Counting(f["images"])
        m = MappedChunks(path, counted, f.id.get_vfd_handle(), path.stat().st_size, "sequential")
        positions = [2999, 5, 1500, 5]
        assert [a.reshape(4, 4, 3).tolist() for a in m.samples(positions, None)] == want[positions].tolist()
        assert m.cached(list(range(64)), None).all()  # just written
        assert counted.lookups == 0 and (m._offsets >= 0).all()
        one_by_one = MappedChunks(path, f["images"], f.id.get_vfd_handle(), path.stat().st_size, "sequential")
        one_by_one._indexed = True
        assert [one_by_one.chunk(c) for c in range(3000)] == m._offsets.tolist()
        m.close()
        # a shard of more chunks than are looked up at once: one by one for a few reads, then in one pass
        monkeypatch.setattr(hdf5_chunks, "INDEX_AT_ONCE", 100)
        monkeypatch.setattr(hdf5_chunks, "LOOKUPS_BEFORE_INDEX", 5)
        counted = Counting(f["images"])
        m = MappedChunks(path, counted, f.id.get_vfd_handle(), path.stat().st_size, "sequential")
        for k, p in enumerate(range(0, 3000, 97)):
            assert np.array_equal(m.flat(p * 48, (p + 1) * 48).reshape(4, 4, 3), want[p])
            assert counted.lookups == min(k + 1, hdf5_chunks.LOOKUPS_BEFORE_INDEX)
        assert (m._offsets >= 0).all()
