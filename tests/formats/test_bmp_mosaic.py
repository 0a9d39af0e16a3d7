"""BMP and mosaic formats: our BMP codec against Pillow, damaged headers, mosaic layout, lossy bounds, loaders."""

from __future__ import annotations

import functools
import hashlib
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.interrupt import kill_after_shards
from support.spawned import Fetch, batches_of, probe_for

from packer import cli, convert, open_dataset
from packer.errors import PackerError
from packer.formats import bmp as bmp_format
from packer.formats import mosaic
from packer.formats.mosaic import geometry as mosaic_geometry
from packer.formats.mosaic import reader as mosaic_reader
from packer.images import bmp as bmpfile
from packer.images.resize import ResizeSpec
from packer.layout.index import shard_starts
from packer.layout.manifest import read_manifest
from packer.read import readahead
from packer.tools.verify import verify


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """Smooth gradients plus texture: compresses and resizes like a photo, distinct per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([(x * rng.uniform(0.5, 2) + y * rng.uniform(0.5, 2)) % 256,
                     128 + 100 * np.sin(x / rng.uniform(3, 9) + y / rng.uniform(4, 11)),
                     (x * y / (h * w) * 255 + rng.uniform(0, 255)) % 256], axis=-1)
    return np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def write_tree(root: Path, sizes: list[tuple[int, int]], classes: int = 2) -> list[Path]:
    """An ImageFolder of JPEGs and PNGs of the given sizes, spread over the classes."""
    files = []
    for k, (h, w) in enumerate(sizes):
        d = root / f"class_{k % classes}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / (f"img_{k:03d}.png" if k % 3 == 0 else f"img_{k:03d}.jpg")
        Image.fromarray(photo(h, w, k)).save(path, quality=90)
        files.append(path)
    return files


def pillow_reference(path: Path, spec: ResizeSpec | None) -> np.ndarray:
    px = np.asarray(Image.open(path).convert("RGB"))
    return spec.apply(px) if spec is not None else px


SIZES = [(31, 45), (40, 33), (17, 61), (50, 50), (23, 29), (64, 37), (33, 70), (45, 31), (29, 27), (38, 52),
         (61, 17), (27, 44), (36, 36), (44, 58)]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src") / "imgs"
    write_tree(root, SIZES)
    return root


# ------------------------------------------------------------------ the BMP codec


@pytest.mark.parametrize("h,w", [(1, 1), (1, 2), (2, 3), (5, 7), (13, 1), (9, 10), (16, 16), (11, 33)])
def test_bmp_written_by_us_read_identically_by_pillow_and_by_us(tmp_path, h, w):
    px = photo(h, w, h * 100 + w)
    data = bmpfile.encode(px)
    assert len(data) == 54 + bmpfile.row_stride(w) * h  # rows padded to 4 bytes
    path = tmp_path / "x.bmp"
    path.write_bytes(data)
    with Image.open(path) as img:
        assert img.format == "BMP" and img.mode == "RGB"
        assert np.array_equal(np.asarray(img), px)
    assert np.array_equal(bmpfile.read(path), px)


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 7])
def test_bmp_written_by_pillow_read_identically_by_us(tmp_path, w):
    px = photo(6, w, w)
    path = tmp_path / "p.bmp"
    Image.fromarray(px).save(path, "BMP")
    assert np.array_equal(bmpfile.read(path), px)


def test_top_down_bmp_and_region(tmp_path):
    px = photo(7, 5, 3)
    data = bytearray(bmpfile.encode(px))
    struct.pack_into("<i", data, 22, -7)  # negative height: rows stored top row first
    stride = bmpfile.row_stride(5)
    rows = [bytes(data[54 + r * stride: 54 + (r + 1) * stride]) for r in range(7)]
    data[54:] = b"".join(reversed(rows))
    path = tmp_path / "td.bmp"
    path.write_bytes(bytes(data))
    assert np.array_equal(bmpfile.read(path), px)
    assert np.array_equal(np.asarray(Image.open(path).convert("RGB")), px)
    header = bmpfile.parse_header(bytes(data), len(data), path)
    assert np.array_equal(bmpfile.region(bytes(data), header, 2, 1, 3, 4), px[2:5, 1:5])


def _damaged(data: bytes, kind: str) -> bytes:
    b = bytearray(data)
    if kind == "magic":
        b[0:2] = b"XX"
    elif kind == "truncated":
        return bytes(b[:-5])
    elif kind == "short":
        return bytes(b[:30])
    elif kind == "size-field":
        struct.pack_into("<I", b, 2, len(b) + 100)
    elif kind == "bpp":
        struct.pack_into("<H", b, 28, 32)
    elif kind == "compression":
        struct.pack_into("<I", b, 30, 1)
    elif kind == "width":
        struct.pack_into("<i", b, 18, 0)
    elif kind == "height-huge":
        struct.pack_into("<i", b, 22, 1 << 30)
    elif kind == "offset":
        struct.pack_into("<I", b, 10, len(b))
    elif kind == "info-size":
        struct.pack_into("<I", b, 14, 12)
    return bytes(b)


@pytest.mark.parametrize("kind", ["magic", "truncated", "short", "size-field", "bpp", "compression", "width",
                                  "height-huge", "offset", "info-size"])
def test_damaged_bmp_header_gives_clear_error(tmp_path, kind):
    path = tmp_path / f"bad_{kind}.bmp"
    path.write_bytes(_damaged(bmpfile.encode(photo(9, 11, 1)), kind))
    with pytest.raises(PackerError, match=rf"bad_{kind}\.bmp: damaged BMP file: "):
        bmpfile.read(path)


# ------------------------------------------------------------------ the bmp format


def test_bmp_format_round_trip_tree_names_and_viewer_compatibility(src, tmp_path):
    out = convert(src, tmp_path / "d.bmp", to="bmp", workers=0, progress=False).output
    manifest = read_manifest(out)
    assert manifest.payload == "raw"  # the default payload of a raw-only format
    ds = open_dataset(out, image="numpy")
    assert len(ds) == len(SIZES)
    for i, rel in enumerate(ds.relpaths):  # ds[i]: ImageFolder's order
        f = out / bmp_format.bmp_name(rel)
        assert f.relative_to(out).as_posix() == f"images/{rel}.bmp"
        ref = pillow_reference(src / rel, None)
        assert np.array_equal(ds[i][0], ref)
        assert np.array_equal(np.asarray(Image.open(f).convert("RGB")), ref)  # ordinary BMP: Pillow agrees
    assert verify(out, against=src).ok


def test_bmp_names_never_clash_and_survive_odd_names(tmp_path):
    root = tmp_path / "odd"
    (root / "c").mkdir(parents=True)
    long_stem = "é" * 124  # 248 UTF-8 bytes + ".jpg": valid here, too long once ".bmp" is added
    names = ["a.jpg", "a.png", "A.jpg", "ünïcødé 图像.jpg", long_stem + ".jpg", "back\\slash.png"]
    for k, n in enumerate(names):
        Image.fromarray(photo(8 + k, 9, k)).save(root / "c" / n, format="PNG" if n.endswith("png") else "JPEG")
    out = convert(root, tmp_path / "odd.bmp", to="bmp", workers=0, progress=False).output
    files = sorted(p.relative_to(out).as_posix() for p in (out / "images").rglob("*.bmp"))
    assert len(files) == len(names) == len(set(files))
    assert "images/c/a.jpg.bmp" in files and "images/c/a.png.bmp" in files and "images/c/ünïcødé 图像.jpg.bmp" in files
    assert all(len(Path(f).name.encode()) <= 255 and "\\" not in f for f in files)
    assert bmp_format.bmp_name(f"c/{long_stem}.jpg") == bmp_format.bmp_name(f"c/{long_stem}.jpg")  # deterministic
    ds = open_dataset(out, image="numpy")
    for i, rel in enumerate(ds.relpaths):  # ds[i]: ImageFolder's order
        assert np.array_equal(ds[i][0], pillow_reference(root / rel, None))


def test_bmp_format_resized_and_damaged_file_named(src, tmp_path):
    out = convert(src, tmp_path / "r.bmp", to="bmp", resize="24x20", resize_mode="fit", workers=0,
                  progress=False).output
    ds = open_dataset(out, image="numpy")
    spec = ResizeSpec.parse("24x20", "fit")
    for i, rel in enumerate(ds.relpaths):
        assert np.array_equal(ds[i][0], pillow_reference(src / rel, spec))
    victim = out / bmp_format.bmp_name(ds.relpaths[3])
    victim.write_bytes(_damaged(victim.read_bytes(), "bpp"))
    with pytest.raises(PackerError, match=r"\.bmp: damaged BMP file: 32 bits per pixel"):
        ds[3]
    assert not verify(out).ok  # the checksum catches it too


def test_bmp_refuses_encoded_payload(src, tmp_path):
    with pytest.raises(PackerError, match="stores only raw"):
        convert(src, tmp_path / "e.bmp", to="bmp", payload="encoded", progress=False)


# ------------------------------------------------------------------ mosaic layout


def test_default_grid_is_8_to_32_mb_decoded():
    for th, tw in [(224, 224), (32, 32), (8, 8), (96, 160), (256, 192), (512, 512), (1000, 700)]:
        rows, cols = mosaic_geometry.default_grid(th, tw)
        decoded = rows * cols * th * tw * 3
        assert 8 << 20 <= decoded <= 32 << 20, (th, tw, rows, cols)
        assert 0.5 <= (rows * th) / (cols * tw) <= 2  # roughly square


@pytest.mark.parametrize("codec", ["bmp", "png"])
def test_mosaic_tile_positions_and_partly_filled_last_mosaic(src, tmp_path, codec):
    out = convert(src, tmp_path / f"m.{codec}", to="mosaic", tile="16x24", grid="2x3", codec=codec, workers=0,
                  progress=False).output
    m = read_manifest(out)
    (shard,) = m.shards
    assert shard.facts["samples_per_mosaic"] == [6, 6, 2] and shard.facts["grid"] == [2, 3]
    assert mosaic_geometry.dataset_blocks(m) == [(0, 6), (6, 12), (12, 14)]
    spec = ResizeSpec.parse("16x24")
    ds = open_dataset(out, image="numpy")
    rels = ds.index.rel_paths()
    for k, f in enumerate(shard.files):
        img = np.asarray(Image.open(out / f.name).convert("RGB"))  # each mosaic opens as an ordinary image
        count = shard.facts["samples_per_mosaic"][k]
        assert img.shape == ((2 if count > 3 else 1) * 16, 3 * 24, 3)  # the last one is cut after its used row
        for cell in range(count):
            r, c = divmod(cell, 3)
            tile = img[r * 16:(r + 1) * 16, c * 24:(c + 1) * 24]
            i = 6 * k + cell
            ref = pillow_reference(src / rels[i], spec)
            assert np.array_equal(tile, ref), (k, cell)  # lossless: equal to the resize pipeline's output
            assert np.array_equal(ds[ds.index_map.public(i)][0], ref)  # i: a storage position
    assert not img[:, 2 * 24:].any()  # unused cells of the last mosaic are black
    assert verify(out, against=src).ok


def test_mosaic_fewer_samples_than_planned(src, tmp_path):
    bad = tmp_path / "withbad"
    import shutil

    shutil.copytree(src, bad)
    (bad / "class_0" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (bad / "class_1" / "empty.png").write_bytes(b"")
    res = convert(bad, tmp_path / "wb.mosaic", to="mosaic", tile="16x16", grid="2x2", workers=0, progress=False)
    assert res.num_samples == len(SIZES) and len(res.errors) == 2
    shard = read_manifest(res.output).shards[0]
    assert shard.facts["samples_per_mosaic"] == [4, 4, 4, 2]  # no gaps left by the failed files
    ds = open_dataset(res.output, image="numpy")
    spec = ResizeSpec.parse("16x16")
    assert all(np.array_equal(ds[i][0], pillow_reference(bad / r, spec)) for i, r in enumerate(ds.relpaths))


def test_mosaic_jpeg_bounded_error_and_every_tile_path_agrees(src, tmp_path):
    out = convert(src, tmp_path / "m.jpeg", to="mosaic", tile="32x16", grid="3x2", codec="jpeg", quality=90,
                  workers=0, progress=False).output
    manifest = read_manifest(out)
    mean_bound, max_bound = mosaic.error_bound(manifest.options)
    assert 0 < mean_bound < 10 and 0 < max_bound < 64  # stated: quality 90 -> mean <= 7.4, max <= 56
    spec = ResizeSpec.parse("32x16")
    shard = manifest.shards[0]
    assert [f.name for f in shard.files][-1] == "mosaic-00000-000002.jpg.rst.npy"  # mosaics, then their indexes
    readers = {t: mosaic.Reader(out, shard, "raw", tile_read=t) for t in ("full", "segments", "crop")}
    assert mosaic.Reader(out, shard, "raw", access="random").tile_read == "segments"
    rels = open_dataset(out).index.rel_paths()
    worst_mean = worst_max = 0.0
    for i in np.random.default_rng(0).permutation(len(rels)).tolist():  # random order: no cache help
        a, b, c = (readers[t].read(i) for t in ("full", "segments", "crop"))
        assert np.array_equal(a, b) and np.array_equal(a, c)  # 4:4:4, MCU-aligned: tile alone == whole mosaic
        err = np.abs(a.astype(int) - pillow_reference(src / rels[i], spec).astype(int))
        worst_mean, worst_max = max(worst_mean, err.mean()), max(worst_max, err.max())
    assert 0 < worst_max <= max_bound and worst_mean <= mean_bound  # lossy, within the declared bound
    with Image.open(out / shard.files[0].name) as img:  # restart markers keep it an ordinary JPEG
        assert img.format == "JPEG" and img.size == (2 * 16, 3 * 32)
    assert verify(out, against=src).ok


def test_mosaic_jpeg_tiles_without_libturbojpeg(src, tmp_path, monkeypatch):
    import packer.images.decode

    out = convert(src, tmp_path / "fb.jpeg", to="mosaic", tile="16x16", grid="2x2", codec="jpeg", workers=0,
                  progress=False).output
    shard = read_manifest(out).shards[0]
    expected = [mosaic.Reader(out, shard, "raw", tile_read="full").read(i) for i in range(len(SIZES))]
    monkeypatch.setattr(mosaic_reader, "turbojpeg_handle", lambda: None)
    monkeypatch.setattr(packer.images.decode, "turbojpeg_handle", lambda: None)
    for tile_read in ("crop", "segments"):  # crop falls back to the full decode; segments decode with Pillow
        reader = mosaic.Reader(out, shard, "raw", tile_read=tile_read)
        assert all(np.array_equal(reader.read(i), expected[i]) for i in range(len(SIZES)))


def test_mosaic_jpeg_damaged_index_is_named(src, tmp_path):
    out = convert(src, tmp_path / "di.jpeg", to="mosaic", tile="16x16", grid="2x2", codec="jpeg", workers=0,
                  progress=False).output
    shard = read_manifest(out).shards[0]
    idx_path = out / "mosaic-00000-000001.jpg.rst.npy"
    idx = np.load(idx_path)
    idx[3, 1] = 1 << 40
    np.save(idx_path, idx)
    with pytest.raises(PackerError, match=r"mosaic-00000-000001\.jpg\.rst\.npy: tile index does not describe"):
        mosaic.Reader(out, shard, "raw", tile_read="segments").read(5)


def test_mosaic_refusals(src, tmp_path):
    with pytest.raises(PackerError, match="needs tile="):
        convert(src, tmp_path / "a", to="mosaic", progress=False)
    with pytest.raises(PackerError, match=r"multiples of 16 px .*height 96 or 112, width 224"):
        convert(src, tmp_path / "a", to="mosaic", tile="100x224", codec="jpeg", progress=False)
    with pytest.raises(PackerError, match="tile is an option of to='mosaic' only"):
        convert(src, tmp_path / "a", to="lmdb", tile="16x16", progress=False)
    with pytest.raises(PackerError, match="unknown mosaic codec"):
        convert(src, tmp_path / "a", to="mosaic", tile="16x16", codec="gif", progress=False)
    with pytest.raises(PackerError, match="quality is for codec='jpeg' only"):
        convert(src, tmp_path / "a", to="mosaic", tile="16x16", codec="png", quality=80, progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "a.partial").exists()


def test_mosaic_reader_cache_pickles_and_damage_is_named(src, tmp_path):
    out = convert(src, tmp_path / "c.png", to="mosaic", tile="16x16", grid="2x2", codec="png", workers=0,
                  progress=False).output
    shard = read_manifest(out).shards[0]
    reader = mosaic.Reader(out, shard, "raw", cache_bytes=1)  # a budget below one mosaic still keeps one
    first = reader.read(0)
    first[:] = 0  # tiles are copies: the cache is not harmed
    assert reader.read(1).any() and reader.read(0).any() and len(reader._cache) == 1
    clone = pickle.loads(pickle.dumps(reader))
    assert len(clone._cache) == 0 and np.array_equal(clone.read(5), reader.read(5))
    (out / shard.files[1].name).write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(PackerError, match=r"mosaic-00000-000001\.png: cannot decode mosaic"):
        mosaic.Reader(out, shard, "raw").read(4)
    bmp_out = convert(src, tmp_path / "c.bmp", to="mosaic", tile="16x16", grid="2x2", workers=0, progress=False).output
    bshard = read_manifest(bmp_out).shards[0]
    (bmp_out / bshard.files[2].name).write_bytes(_damaged((bmp_out / bshard.files[2].name).read_bytes(), "magic"))
    with pytest.raises(PackerError, match=r"mosaic-00000-000002\.bmp: damaged BMP file: magic"):
        mosaic.Reader(bmp_out, bshard, "raw").read(9)


def test_info_points_at_a_mosaic(src, tmp_path, capsys):
    out = convert(src, tmp_path / "i.mosaic", to="mosaic", tile="16x16", workers=0, progress=False).output
    assert cli.main(["info", str(out)]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("look at")][0]
    path = Path(line.split()[2])
    assert path.is_file() and Image.open(path).size == (16 * mosaic_geometry.default_grid(16, 16)[1], 16)


def test_cli_convert_mosaic(src, tmp_path, capsys):
    out = tmp_path / "cli.mosaic"
    code = cli.main(["convert", str(src), "--to", "mosaic", "--tile", "32x32", "--grid", "4x4", "--codec", "jpeg",
                     "--quality", "80", "-o", str(out), "-q"])
    assert code == 0
    m = read_manifest(out)
    assert (m.options["tile"], m.options["codec"], m.options["quality"]) == ("32x32", "jpeg", 80)
    assert m.shards[0].facts["samples_per_mosaic"] == [14]


# ------------------------------------------------------------------ DataLoader, fork and spawn


def _as_list(batch):
    return batch


def _digest(arr) -> str:
    return hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()


def _open_kind(src: Path, tmp_path: Path, kind: str):
    if kind == "bmp":
        out = convert(src, tmp_path / "l.bmp", to="bmp", workers=0, progress=False).output
    else:
        out = convert(src, tmp_path / f"l.{kind}", to="mosaic", tile="16x16", grid="2x2", codec=kind.split("-")[1],
                      workers=0, progress=False).output
    ds = open_dataset(out, image="numpy")
    ds.pixels(0)  # a reader used before the workers start must not leak into them
    return ds


def _tagged(tag: str, label: int) -> tuple[str, int]:
    return tag, label


def _expected(ds) -> dict:
    """{(pixels digest, label): index} of every sample, read in this process."""
    expected = {(_digest(img), label): i for i, (img, label) in enumerate(ds[i] for i in range(len(ds)))}
    assert len(expected) == len(ds)
    return expected


def _check_loader(ds, method: str) -> None:
    expected = _expected(ds)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, shuffle=True, num_workers=2, collate_fn=_as_list,
                                         multiprocessing_context=method, generator=torch.Generator().manual_seed(0))
    seen = [expected[(_digest(img), label)] for batch in loader for img, label in batch]  # pixels and label intact
    assert sorted(seen) == list(range(len(ds)))  # every sample exactly once


KINDS = ["bmp", "mosaic-bmp", "mosaic-png", "mosaic-jpeg"]


@pytest.mark.parametrize("kind", KINDS)
def test_dataloader_two_fork_workers(src, tmp_path, kind):
    _check_loader(_open_kind(src, tmp_path, kind), "fork")


def _every_kind(src: Path, tmp_path: Path):
    parts = [_open_kind(src, tmp_path, k) for k in KINDS]
    for kind, part in zip(KINDS, parts, strict=True):
        part.target_transform = functools.partial(_tagged, kind)  # same pixels in several kinds: tell them apart
    return torch.utils.data.ConcatDataset(parts)


def test_dataloader_two_spawn_workers_over_every_kind(spawned):
    """Read by the session's spawned workers (_spawned_kinds): all four kinds at once."""
    expected = _expected(spawned.context)
    seen = [expected[(_digest(img), label)] for batch in spawned.values() for img, label in batch]
    assert sorted(seen) == list(range(len(expected)))  # every sample exactly once, pixels and label intact


@probe_for(test_dataloader_two_spawn_workers_over_every_kind)
def _spawned_kinds(tmp_path_factory):
    """Shuffled batches of 3 over the four kinds, each reader used in the parent before. Context: the dataset."""
    base = tmp_path_factory.mktemp("bmp-mosaic")
    src = base / "src"
    write_tree(src, SIZES)
    ds = _every_kind(src, base)
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(0)).tolist()
    return Fetch(ds, batches_of(len(ds), 3, order)), ds


@pytest.mark.parametrize("codec,tile_read", [("bmp", "region"), ("png", "full"), ("jpeg", "segments"),
                                             ("jpeg", "full"), ("jpeg", "crop")])
def test_file_spans_then_read(src, tmp_path, codec, tile_read):
    out = convert(src, tmp_path / f"p.{codec}", to="mosaic", tile="16x16", grid="2x3", codec=codec, workers=0,
                  progress=False).output
    shard = read_manifest(out).shards[0]
    expected = [mosaic.Reader(out, shard, "raw", tile_read=tile_read).read(i) for i in range(len(SIZES))]
    reader = mosaic.Reader(str(out), shard, "raw", tile_read=tile_read)  # a str directory works too
    spans = reader.file_spans([13, 0, 7, 7, 2])
    assert [len(r) for r in spans] == [1] * 5 and all(0 <= a < b for r in spans for _p, a, b in r)
    readahead.start(spans).wait(4, timeout=10)
    assert all(np.array_equal(reader.read(i), expected[i]) for i in (13, 0, 7, 2))
    spans = reader.file_spans(list(range(len(SIZES))))  # whole-mosaic decoding: cached mosaics need no bytes
    if tile_read == "full":
        assert sum(not r for r in spans) >= 3
    readahead.start(spans).wait(len(SIZES) - 1, timeout=10)
    assert all(np.array_equal(reader.read(i), expected[i]) for i in range(len(SIZES)))


def test_mutated_bmp_headers_read_right_or_raise_packer_error(tmp_path):
    """Seeded fuzz of the header bytes: our parser returns the true pixels or a PackerError, nothing else."""
    px = photo(7, 9, 5)
    good = bmpfile.encode(px)
    rng = np.random.default_rng(0)
    outcomes = {"ok": 0, "error": 0}
    for case in range(300):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, 54))] = int(rng.integers(0, 256))
        if case % 5 == 0:
            data = data[: int(rng.integers(0, len(data)))]
        path = tmp_path / "f.bmp"
        path.write_bytes(bytes(data))
        try:
            img = bmpfile.read(path)
        except PackerError as exc:
            assert "f.bmp" in str(exc)
            outcomes["error"] += 1
        else:
            assert img.shape == px.shape  # fields we don't rely on (resolution, reserved) may change freely
            outcomes["ok"] += 1
    assert outcomes["error"] > 100 and outcomes["ok"] > 10


def test_mutated_jpeg_mosaic_tiles_read_or_raise_packer_error(src, tmp_path):
    out = convert(src, tmp_path / "fz.jpeg", to="mosaic", tile="16x16", grid="2x2", codec="jpeg", workers=0,
                  progress=False).output
    shard = read_manifest(out).shards[0]
    target = out / shard.files[0].name
    good = target.read_bytes()
    rng = np.random.default_rng(1)
    for case in range(150):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 6))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        if case % 4 == 0:
            data = data[: int(rng.integers(0, len(data)))]
        target.write_bytes(bytes(data))
        for tile_read in ("segments", "full"):
            try:
                tile = mosaic.Reader(out, shard, "raw", tile_read=tile_read).read(int(rng.integers(0, 4)))
            except PackerError:
                continue
            assert tile.shape == (16, 16, 3)  # damaged entropy data may still decode (to wrong pixels)


def test_shards_hold_whole_mosaics_and_the_sampler_reads_one_mosaic_per_block(src, tmp_path):
    from packer.read.sampler import BlockShuffleSampler, block_boundaries

    # 16x16 tiles are 768 bytes: a 6-tile shard cap rounds down to whole 2x2 mosaics of 4.
    out = convert(src, tmp_path / "s.mosaic", to="mosaic", tile="16x16", grid="2x2", shard_bytes=768 * 6, workers=0,
                  progress=False).output
    m = read_manifest(out)
    assert [s.facts["samples_per_mosaic"] for s in m.shards] == [[4], [4], [4], [2]]
    assert mosaic_geometry.dataset_blocks(m) == [(0, 4), (4, 8), (8, 12), (12, 14)]
    ds = open_dataset(out, image="numpy")
    assert ds.block_boundaries().tolist() == [0, 4, 8, 12, 14]
    sampler = BlockShuffleSampler(ds, seed=3)
    assert sampler.bounds.tolist() == [0, 4, 8, 12, 14]  # picked up by itself: one mosaic per block
    assert sorted(sampler) == list(range(len(ds)))
    bmp = open_dataset(convert(src, tmp_path / "b.bmp", to="bmp", workers=0, progress=False).output)
    assert bmp.block_boundaries() is None  # formats without natural blocks: the sampler cuts by bytes
    cuts = shard_starts([s.num_samples for s in bmp.manifest.shards])[1:-1]
    assert BlockShuffleSampler(bmp, block_bytes=20_000).bounds.tolist() == \
        block_boundaries(bmp.index.nbytes, 20_000, cuts).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--to", "bmp", "--shard-size", "20000"],
                                  ["--to", "mosaic", "--tile", "16x16", "--grid", "2x2", "--codec", "jpeg",
                                   "--shard-size", "6000"]], ids=["bmp", "mosaic-jpeg"])
def test_resume_after_sigkill_is_byte_identical(tmp_path, args):
    """Killed mid-conversion, then --resume: the same files as an uninterrupted run (mosaics, indexes, BMPs)."""
    import os
    import subprocess
    import sys

    source = write_tree(tmp_path / "src", [(40 + k % 7, 50 + k % 5) for k in range(80)], classes=3)[0].parents[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    base = [sys.executable, "-m", "packer", "convert", str(source), "--workers", "1", "-q", *args]
    subprocess.run(base + ["-o", str(tmp_path / "ref")], env=env, check=True, capture_output=True)
    out, journal = tmp_path / "out", tmp_path / "out.partial" / "journal"
    kill_after_shards(base + ["-o", str(out)], env, journal, shards=2)
    res = subprocess.run(base + ["-o", str(out), "--resume"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr

    def files(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
                if p.is_file() and p.name != "manifest.json"}

    assert files(out) == files(tmp_path / "ref")
    assert verify(out, against=source).ok
