"""The compiled JPEG region decoder (packer.images.jpegregion): the same pixels as a whole decode's rows and
columns at every DCT scale and JPEG kind, errors as DecodeError (never a crash), the pixel limit, and the fused
crop through it against the whole-decode path (docs/decoding.md states these bounds)."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import threading

import numpy as np
import pytest
from PIL import Image
from support.imagesets import jpeg_bytes

from packer import CenterCropDecode, RandomResizedCropDecode
from packer.images.crop import decode_window, decode_windows, resize_window, window_scale
from packer.images.decode import DecodeError, decode
from packer.images.jpegregion import decode_region, decode_regions
from packer.tools.sample import photo_like

# The fused crop through the region decoder against the same crop through a whole decode: identical for a
# window on whole pixels (RandomResizedCrop at full scale: both cut the same pixels); within 1 for a
# fractional box (a DCT scale, the eval crop): PIL's filter placed on the box shifted to the region's origin
# rounds its float positions differently.
MAX_DIFF_WHOLE_PIXELS, MAX_DIFF_FRACTIONAL = 0, 1

KINDS = {  # Pillow save options: the JPEG kinds the region decoder must give whole-decode pixels for
    "420": {"subsampling": 2},
    "422": {"subsampling": 1},
    "444": {"subsampling": 0},
    "progressive": {"progressive": True},
    "restart-markers": {"restart_marker_blocks": 3},
    "restart-per-mcu": {"restart_marker_blocks": 1},  # the fast path: only the region's MCUs are read
}


def whole(data: bytes, d: int, shape: tuple[int, int]) -> np.ndarray:
    """The whole image decoded at 1/d (the decoder's min_size that gives this d): libjpeg-turbo, Pillow for CMYK."""
    pixels = decode(data, min_size=-(-min(shape) // d) if d > 1 else None)
    assert pixels.shape[:2] == (-(-shape[0] // d), -(-shape[1] // d))
    return pixels


def regions(rng: np.random.Generator, h: int, w: int, n: int) -> list[tuple[int, int, int, int]]:
    """Corners and edges first (whole image, one pixel at each end), then random rectangles."""
    out = [(0, 0, h, w), (0, 0, 1, 1), (h - 1, w - 1, 1, 1), (h // 2, 0, 1, w), (0, w // 2, h, 1)]
    for _ in range(n):
        top, left = int(rng.integers(0, h)), int(rng.integers(0, w))
        out.append((top, left, int(rng.integers(1, h - top + 1)), int(rng.integers(1, w - left + 1))))
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", [(375, 500), (61, 97)])
def test_region_is_the_whole_decodes_rows_and_columns(jpegregion, turbojpeg, kind, shape):
    rng = np.random.default_rng(0)
    data = jpeg_bytes(rng, *shape, **KINDS[kind])
    for d in (1, 2, 4, 8):
        full = whole(data, d, shape)
        for top, left, h, w in regions(rng, *full.shape[:2], 12):
            got = decode_region(data, d, top, left, h, w, shape)
            assert got is not None and np.array_equal(got, full[top:top + h, left:left + w]), (d, top, left, h, w)


def test_grayscale_comes_back_as_rgb(jpegregion, turbojpeg):
    buf = io.BytesIO()
    photo_like(np.random.default_rng(1), 200, 300).convert("L").save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    full = whole(data, 1, (200, 300))
    got = decode_region(data, 1, 17, 33, 100, 150, (200, 300))
    assert got is not None and np.array_equal(got, full[17:117, 33:183])
    assert np.array_equal(got[..., 0], got[..., 2])


def test_cmyk_is_left_to_the_whole_decode(jpegregion):
    buf = io.BytesIO()
    photo_like(np.random.default_rng(2), 80, 120).convert("CMYK").save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    assert decode_region(data, 1, 0, 0, 10, 10, (80, 120)) is None
    spec = CenterCropDecode(32, resize=40)
    win = spec.window(80, 120, 0)
    d = window_scale(win, spec.size)
    want = resize_window(whole(data, d, (80, 120)), win, spec.size, d)  # Pillow's CMYK conversion
    assert d == 2 and np.array_equal(decode_window(data, win, spec.size, 80, 120), want)


def test_writes_into_out_when_it_fits(jpegregion):
    data = jpeg_bytes(np.random.default_rng(3), 120, 160)
    out = np.zeros((40, 50, 3), np.uint8)
    assert decode_region(data, 1, 10, 20, 40, 50, (120, 160), out=out) is out
    other = decode_region(data, 1, 10, 20, 40, 50, (120, 160), out=np.zeros((4, 5, 3), np.uint8))
    assert other is not None and np.array_equal(other, out) and out.any()


def test_corrupt_data_is_a_decode_error_not_a_crash(jpegregion):
    data = jpeg_bytes(np.random.default_rng(4), 240, 320)
    half = data[:len(data) // 2]
    with pytest.raises(DecodeError, match="cannot decode JPEG"):
        decode_region(half, 1, 200, 0, 40, 320, (240, 320))  # rows past the truncation, strict
    loose = decode_region(half, 1, 200, 0, 40, 320, (240, 320), strict=False)  # libjpeg fills what is missing
    assert loose is not None and loose.shape == (40, 320, 3)
    assert decode_region(half, 1, 0, 0, 16, 320, (240, 320)) is not None  # the rows read are all there
    garbled = data[:600] + bytes(range(256)) * 8 + data[600 + 2048:]
    for bad in (garbled, data[:300], b"\xff\xd8\xff" + b"\x00" * 100, b""):
        with pytest.raises(DecodeError):
            decode_region(bad, 1, 0, 0, 240, 320, (240, 320))
    for top, left, h, w in ((100, 0, 30, 10), (0, 150, 10, 20), (2**32 - 1, 0, 2, 10)):  # 1/2 scale: 120 x 160
        with pytest.raises(DecodeError, match="outside"):
            decode_region(data, 2, top, left, h, w, (240, 320))


def test_pixel_limit_is_checked_before_decoding(jpegregion, monkeypatch):
    data = jpeg_bytes(np.random.default_rng(5), 100, 100)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)  # the limit: 2 x 4000 pixels
    with pytest.raises(DecodeError, match="pixel limit"):
        decode_region(data, 1, 0, 0, 10, 10, (100, 100))
    with pytest.raises(DecodeError, match="pixel limit"):  # the header's own size, whatever the caller says
        decode_region(data, 1, 0, 0, 10, 10, (10, 10))


def test_threads_decode_together(jpegregion, turbojpeg):
    rng = np.random.default_rng(6)
    datas = [jpeg_bytes(rng, 150, 200) for _ in range(4)]
    want = [whole(d, 1, (150, 200))[20:120, 30:180] for d in datas]
    results: list[bool] = []

    def work() -> None:
        for _ in range(20):
            results.extend(np.array_equal(decode_region(d, 1, 20, 30, 100, 150, (150, 200)), w)
                           for d, w in zip(datas, want))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 240 and all(results)


@pytest.mark.parametrize("shape", [(375, 500), (900, 1200), (1500, 2000)])
def test_fused_crop_matches_the_whole_decode_path(jpegregion, turbojpeg, shape):
    rng = np.random.default_rng(7)
    data = jpeg_bytes(rng, *shape)
    for spec in (RandomResizedCropDecode(224, seed=1), CenterCropDecode(224, resize=256)):
        for i in range(10):
            win = spec.window(*shape, i)
            d = window_scale(win, spec.size)
            want = resize_window(whole(data, d, shape), win, spec.size, d)  # the path without the region decoder
            got = decode_window(data, win, spec.size, *shape)
            on_whole_pixels = all(float(v).is_integer() for v in (win.top, win.left, win.height, win.width))
            bound = MAX_DIFF_WHOLE_PIXELS if on_whole_pixels and d == 1 else MAX_DIFF_FRACTIONAL
            assert np.abs(got.astype(np.int16) - want).max() <= bound, (type(spec).__name__, i, d)


def test_decode_regions_is_decode_region_item_by_item(jpegregion, turbojpeg):
    """One call for many: each item done has decode_region's pixels; the others say why by their status (0: leave it
    to the one-by-one path, 2: an error there) and leave the rest of the call unharmed."""
    rng = np.random.default_rng(9)
    datas, rows, want = [], [], []
    for kind in sorted(KINDS):
        shape = (int(rng.integers(40, 200)), int(rng.integers(40, 200)))
        data = jpeg_bytes(rng, *shape, **KINDS[kind])
        for d in (1, 2, 8):
            full = whole(data, d, shape)
            for top, left, h, w in regions(rng, *full.shape[:2], 2):
                datas.append(data)
                rows.append((d, top, left, *shape))
                want.append(full[top:top + h, left:left + w])
    outs = [np.zeros_like(w) for w in want]
    status = decode_regions(datas, np.array(rows, dtype=np.int64), outs, strict=True)
    assert status == b"\x01" * len(datas)
    assert all(np.array_equal(got, w) for got, w in zip(outs, want))

    data = jpeg_bytes(rng, 120, 160)
    cmyk = io.BytesIO()
    photo_like(rng, 80, 120).convert("CMYK").save(cmyk, "JPEG", quality=90)
    png = io.BytesIO()
    photo_like(rng, 80, 120).save(png, "PNG")
    cases = [  # (data, region row, out shape, status)
        (data, (1, 10, 20, 120, 160), (30, 40), 1),
        (data, (1, 10, 20, 120, 161), (30, 40), 0),  # the header says another size than the index
        (png.getvalue(), (1, 0, 0, 80, 120), (10, 10), 0),  # not a JPEG
        (cmyk.getvalue(), (1, 0, 0, 80, 120), (10, 10), 0),  # CMYK: the whole decode's Pillow path
        (data, (3, 0, 0, 120, 160), (10, 10), 0),  # no such DCT scale
        (data, (1, 0, 0, 0, 0), (10, 10), 0),  # no image size known
        (data, (1, 0, 0, 120, 70000), (10, 10), 0),  # sizes no JPEG has: that item alone left undone
        (data, (1, -1, 0, 120, 160), (10, 10), 0),
        (data, (2, 50, 0, 120, 160), (30, 10), 2),  # rows 50..80 of a 60-row image at 1/2
        (data[:len(data) // 2], (1, 100, 0, 120, 160), (20, 160), 2),  # truncated within the rows read, strict
        (b"\xff\xd8\xff" + bytes(100), (1, 0, 0, 120, 160), (10, 10), 2),
        (data, (1, 0, 0, 120, 160), (120, 160), 1),
    ]
    outs = [np.zeros((*shape, 3), np.uint8) for _, _, shape, _ in cases]
    status = decode_regions([c[0] for c in cases], np.array([c[1] for c in cases], dtype=np.int64), outs, True)
    assert list(status) == [c[3] for c in cases]
    full = whole(data, 1, (120, 160))
    assert np.array_equal(outs[0], full[10:40, 20:60]) and np.array_equal(outs[-1], full)
    loose = decode_regions([cases[9][0]], np.array([cases[9][1]], dtype=np.int64), [outs[9]], strict=False)
    assert loose == b"\x01"  # libjpeg fills in what is missing when not strict

    good = np.array([cases[0][1]], dtype=np.int64)
    for bad in (good.astype(np.int32), good[:, :4].copy(), np.vstack([good, good])):
        with pytest.raises(ValueError, match="regions"):
            decode_regions([data], bad, [outs[0]])
    with pytest.raises(ValueError, match="contiguous"):
        decode_regions([data], np.repeat(good, 2, axis=1)[:, ::2], [outs[0]])  # strided
    assert decode_regions([], np.empty((0, 5), np.int64), []) == b""


def test_decode_windows_is_decode_window_item_by_item(jpegregion, turbojpeg):
    """The bulk fused crop (a decode thread's chunk) gives each item decode_window's pixels: whole and fractional
    windows, DCT scales, flips; an item it leaves (PNG, a header unlike the size given) is 0, the rest still done."""
    rng = np.random.default_rng(10)
    shapes = [(375, 500), (500, 375), (900, 1200), (61, 97)]
    datas = [jpeg_bytes(rng, *shape) for shape in shapes]
    png = io.BytesIO()
    photo_like(rng, 80, 120).save(png, "PNG")
    for spec in (RandomResizedCropDecode(64, seed=3), CenterCropDecode(48, resize=56), RandomResizedCropDecode(224)):
        items = [(datas[k % 4], shapes[k % 4], k) for k in range(12)] + [(png.getvalue(), (80, 120), 12)]
        heights, widths = [s[0] for _, s, _ in items], [s[1] for _, s, _ in items]
        heights[5] += 1  # the index and the header disagree: left to the one-by-one path
        windows = spec.windows(heights, widths, [i for _, _, i in items])
        outs = [np.zeros((*spec.size, 3), np.uint8) for _ in items]
        status = decode_windows([d for d, _, _ in items], windows, spec.size, heights, widths, outs)
        assert status is not None and list(status) == [1] * 5 + [0] + [1] * 6 + [0]
        for k, (data, shape, _) in enumerate(items[:12]):
            if k != 5:
                assert np.array_equal(outs[k], decode_window(data, windows[k], spec.size, *shape)), (spec, k)
        assert not outs[5].any() and not outs[12].any()


def test_decode_windows_allocates_only_what_the_pixel_limit_allows(jpegregion):
    """A header (and index) claiming a size above the pixel limit gets no region memory in bulk: a 64x64 JPEG saying
    40000x40000 would have had 75 MB of scratch per item at 1/8. Scratch above KEEP bytes is not kept."""
    import tracemalloc

    from packer.images import crop as crops

    data = bytearray(jpeg_bytes(np.random.default_rng(12), 64, 64))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = (40000).to_bytes(2, "big") * 2
    outs = [np.zeros((224, 224, 3), np.uint8) for _ in range(4)]
    tracemalloc.start()
    try:
        status = decode_windows([bytes(data)] * 4, [crops.Window(0, 0, 40000, 40000)] * 4, (224, 224), [40000] * 4,
                                [40000] * 4, outs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert status == bytes(4) and peak < 10 << 20 and not any(o.any() for o in outs)

    def scratch_after(keep: int) -> int:
        crops._scratch.block = np.empty(0, np.uint8)
        crops._Scratch.KEEP = keep
        small = jpeg_bytes(np.random.default_rng(13), 120, 160)
        done = decode_windows([small], [crops.Window(0, 0, 120, 160)], (60, 80), [120], [160],
                              [np.zeros((60, 80, 3), np.uint8)])
        assert done == b"\x01"
        return crops._scratch.block.nbytes

    keep = crops._Scratch.KEEP
    try:
        assert scratch_after(keep) == 60 * 80 * 3  # the region at 1/2, kept for the thread's next call
        assert scratch_after(1000) == 0  # above KEEP: not kept
    finally:
        crops._Scratch.KEEP = keep


def test_windows_draw_as_window_does_sample_by_sample():
    """``windows`` for a chunk takes the per-process stream's draws in one call: the crops ``window`` would give."""
    heights, widths = [375, 500, 90, 1200], [500, 375, 4000, 1300]
    for spec in (RandomResizedCropDecode(224), RandomResizedCropDecode(32, seed=5), CenterCropDecode(224)):
        twin = copy.deepcopy(spec)  # the same stream state
        for start in (0, 4):
            many = spec.windows(heights, widths, list(range(start, start + 4)))
            assert many == [twin.window(h, w, start + k) for k, (h, w) in enumerate(zip(heights, widths))]


def test_packer_works_without_the_extension(tmp_path):
    """Importing packer and the fused crop work when the .so is missing: one notice, the whole-decode path."""
    data = jpeg_bytes(np.random.default_rng(8), 120, 160)
    (tmp_path / "x.jpg").write_bytes(data)
    script = (
        "import sys; sys.modules['packer.images._jpegregion'] = None\n"  # an import of it now fails
        "import numpy as np, packer\n"
        "from packer.images.crop import decode_window, resize_window\n"
        "from packer.images.decode import decode\n"
        "from packer.images.jpegregion import region_decode_available\n"
        "assert not region_decode_available()\n"
        f"data = open({str(tmp_path / 'x.jpg')!r}, 'rb').read()\n"
        "spec = packer.RandomResizedCropDecode(64, seed=0)\n"
        "for i in range(3):\n"
        "    w = spec.window(120, 160, i)\n"
        "    want = resize_window(decode(data), w, spec.size)\n"
        "    assert np.array_equal(decode_window(data, w, spec.size, 120, 160), want)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    notices = [line for line in run.stderr.splitlines() if "region decoder is not built" in line]
    assert len(notices) == 1 and "libjpeg62-turbo-dev" in notices[0]
