"""The lossless restart-marker rewrite (``restart_transcode``) and the region decode it enables: the rewritten
JPEG decodes to the source's pixels (libjpeg-turbo and Pillow), keeps its metadata, and a region of it decodes
from the region's MCUs alone -- the same pixels as a whole decode, with the data around the region never read."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image
from support.imagesets import jpeg_bytes

from packer import CenterCropDecode, RandomResizedCropDecode
from packer.images.decode import DecodeError, decode
from packer.images.jpegregion import decode_region, restart_transcode
from packer.tools.sample import photo_like

KINDS = {  # Pillow save options of the sources rewritten
    "420": {"subsampling": 2},
    "422": {"subsampling": 1},
    "444": {"subsampling": 0},
    "progressive": {"progressive": True},
    "restart-every-3": {"restart_marker_blocks": 3},
}
SHAPES = [(375, 500), (61, 97), (17, 300), (300, 9)]


def pil_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def markers(data: bytes) -> list[tuple[int, bytes]]:
    """(marker, payload) of each header segment up to the scan."""
    out, i = [], 2
    while data[i + 1] != 0xDA:
        (length,) = struct.unpack_from(">H", data, i + 2)
        out.append((data[i + 1], data[i + 4:i + 2 + length]))
        i += 2 + length
    return out


def restart_interval(data: bytes) -> int | None:
    return next((struct.unpack(">H", p[:2])[0] for m, p in markers(data) if m == 0xDD), None)


def mcu_segments(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each restart interval's entropy-coded bytes."""
    i = 2
    while data[i + 1] != 0xDA:
        i += 2 + struct.unpack_from(">H", data, i + 2)[0]
    start = i + 2 + struct.unpack_from(">H", data, i + 2)[0]
    segments, j = [], start
    while True:
        j = data.index(b"\xff", j)
        if data[j + 1] == 0:
            j += 2
            continue
        segments.append((start, j))
        if data[j + 1] == 0xD9:
            return segments
        start = j = j + 2


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("shape", SHAPES)
def test_rewrite_keeps_the_pixels_and_marks_every_mcu(jpegregion, turbojpeg, kind, shape):
    source = jpeg_bytes(np.random.default_rng(3), *shape, **KINDS[kind])
    rewritten = restart_transcode(source)
    assert rewritten is not None and rewritten != source
    assert restart_interval(rewritten) == 1
    assert np.array_equal(decode(rewritten), decode(source))  # libjpeg-turbo
    assert np.array_equal(pil_pixels(rewritten), pil_pixels(source))  # Pillow's own libjpeg
    assert 0.8 < len(rewritten) / len(source) < 1.3, len(rewritten) / len(source)  # Huffman tables re-optimized


def test_rewrite_keeps_grayscale_and_metadata(jpegregion, turbojpeg):
    img = photo_like(np.random.default_rng(4), 120, 90)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=88, exif=exif.tobytes(), icc_profile=b"\x00" * 300, comment=b"kept")
    source = buf.getvalue()
    rewritten = restart_transcode(source)
    assert rewritten is not None
    kept = [m for m in markers(rewritten) if m[0] in (0xE1, 0xE2, 0xFE)]
    assert kept == [m for m in markers(source) if m[0] in (0xE1, 0xE2, 0xFE)] and len(kept) == 3
    assert Image.open(io.BytesIO(rewritten)).getexif()[0x0112] == 6
    gray = io.BytesIO()
    img.convert("L").save(gray, "JPEG", quality=90)
    rewritten = restart_transcode(gray.getvalue())
    assert rewritten is not None and np.array_equal(decode(rewritten), decode(gray.getvalue()))


def test_what_cannot_be_rewritten_stays_as_it_is(jpegregion):
    rng = np.random.default_rng(5)
    cmyk = io.BytesIO()
    photo_like(rng, 40, 60).convert("CMYK").save(cmyk, "JPEG")
    png = io.BytesIO()
    photo_like(rng, 40, 60).save(png, "PNG")
    good = jpeg_bytes(rng, 64, 64)
    for data in (cmyk.getvalue(), png.getvalue(), good[: len(good) // 2], b"", b"\xff\xd8\xff"):
        assert restart_transcode(data) is None


@pytest.mark.parametrize("kind", ["420", "422", "444", "progressive"])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_region_of_the_rewrite_is_the_whole_decodes(jpegregion, turbojpeg, kind, shape):
    rng = np.random.default_rng(6)
    data = restart_transcode(jpeg_bytes(rng, *shape, **KINDS[kind]))
    for d in (1, 2, 4, 8):
        full = decode(data, min_size=-(-min(shape) // d) if d > 1 else None)
        h, w = full.shape[:2]
        boxes = [(0, 0, h, w), (0, 0, 1, 1), (h - 1, w - 1, 1, 1), (h // 2, 0, 1, w), (0, w // 2, h, 1)]
        for _ in range(25):
            top, left = int(rng.integers(0, h)), int(rng.integers(0, w))
            boxes.append((top, left, int(rng.integers(1, h - top + 1)), int(rng.integers(1, w - left + 1))))
        for top, left, rh, rw in boxes:
            got = decode_region(data, d, top, left, rh, rw, shape)
            assert got is not None and np.array_equal(got, full[top:top + rh, left:left + rw]), (d, top, left, rh, rw)


def test_a_region_reads_only_its_own_mcus(jpegregion, turbojpeg):
    """MCU 0's bytes replaced by invalid Huffman codes (all one bits): a whole decode fails on them, a region
    away from the image's first MCU row decodes as before -- its decode never read them."""
    data = restart_transcode(jpeg_bytes(np.random.default_rng(7), 160, 240))
    start, end = mcu_segments(data)[0]
    damaged = data[:start] + b"\xff\x00" * max(1, (end - start) // 2) + data[end:]
    with pytest.raises(DecodeError):
        decode(damaged, "turbojpeg")
    with pytest.raises(DecodeError):
        decode_region(damaged, 1, 0, 0, 8, 8, (160, 240))
    full = decode(data)
    got = decode_region(damaged, 1, 40, 100, 80, 90, (160, 240))
    assert got is not None and np.array_equal(got, full[40:120, 100:190])


def test_the_fused_crops_are_the_sources(jpegregion, turbojpeg):
    rng = np.random.default_rng(8)
    for shape in SHAPES[:3]:
        source = jpeg_bytes(rng, *shape)
        rewritten = restart_transcode(source)
        for crop in (RandomResizedCropDecode(32, seed=1), RandomResizedCropDecode((64, 48), seed=2),
                     CenterCropDecode(16, resize=20)):
            for i in range(20):
                assert np.array_equal(crop.from_bytes(rewritten, i, *shape), crop.from_bytes(source, i, *shape))
