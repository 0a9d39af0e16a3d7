"""The lossless restart-marker rewrite (``restart_transcode``) and the region decode it enables: the rewritten
JPEG decodes to the source's pixels (libjpeg-turbo and Pillow), keeps its metadata, and a region of it decodes
from the region's MCUs alone -- the same pixels as a whole decode, with the data around the region never read."""

from __future__ import annotations

import io
import struct
import subprocess
import sys

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


# ------------------------------------------------------------------ crafted inputs (a hostile review's findings)


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def test_an_error_after_the_output_grew_is_none_not_a_crash(jpegregion):
    """A DC coefficient wider than 8-bit JPEG allows decodes (libjpeg says nothing) but can't be re-encoded: the
    encoder's error comes after the 5 KB APP1 grew the output buffer. Run apart: a double free aborts a process."""
    code = """if True:
        import struct
        from packer.images.jpegregion import restart_transcode
        def seg(m, p): return bytes([0xFF, m]) + struct.pack(">H", len(p) + 2) + p
        bits = "0" + format(5000, "013b") + "0"  # DC of category 13, then EOB
        bits += "1" * (-len(bits) % 8)
        scan = bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8)).replace(b"\\xff", b"\\xff\\x00")
        jpeg = (b"\\xff\\xd8" + seg(0xE1, b"Exif\\0\\0" + bytes(5000)) + seg(0xDB, b"\\0" + bytes([1] * 64))
                + seg(0xC0, b"\\x08\\x00\\x08\\x00\\x08\\x01\\x01\\x11\\x00")
                + seg(0xC4, b"\\x00" + bytes([1] + [0] * 15) + b"\\x0d")
                + seg(0xC4, b"\\x10" + bytes([1] + [0] * 15) + b"\\x00")
                + seg(0xDA, b"\\x01\\x01\\x00\\x00\\x3f\\x00") + scan + b"\\xff\\xd9")
        print(restart_transcode(jpeg))
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "None", (run.returncode, run.stdout, run.stderr[-500:])


def test_a_marker_without_length_in_the_header_keeps_the_region_exact(jpegregion, turbojpeg):
    """RST0 before an APP5 (libjpeg skips it): a header parse reading it as a segment with a length would land
    in the APP5's payload, on a fake frame header, and patch that instead of the real one."""
    buf = io.BytesIO()
    photo_like(np.random.default_rng(9), 64, 64).save(buf, "JPEG", quality=90, subsampling=0)
    good = restart_transcode(buf.getvalue())
    sos = good.index(b"\xff\xda")
    payload = bytearray(65531)
    off = 65505
    payload[off:off + 19] = b"\xff\xc0\x00\x11\x08\x00\x40\x00\x40\x03\x01\x11\x00\x02\x11\x01\x03\x11\x01"
    rest = 65531 - off - 19
    payload[off + 19:] = b"\xff\xfe" + struct.pack(">H", rest - 2) + bytes(rest - 4)
    data = good[:sos] + b"\xff\xd0" + b"\xff\xe5\xff\xfd" + bytes(payload) + good[sos:]
    full = decode(data)
    assert np.array_equal(full, decode(good))
    for top, left, h, w in ((24, 8, 16, 40), (0, 0, 8, 8), (40, 40, 24, 24), (10, 3, 30, 50)):
        got = decode_region(data, 1, top, left, h, w, (64, 64))
        assert got is not None and np.array_equal(got, full[top:top + h, left:left + w]), (top, left, h, w)


def test_a_progressive_jpeg_with_unrefined_scans_is_kept(jpegregion, turbojpeg):
    """Without its refinement scans a progressive JPEG still decodes, libjpeg smoothing the unrefined blocks;
    a baseline rewrite of its coefficients would not be smoothed: other pixels. It stays as it is."""
    buf = io.BytesIO()
    photo_like(np.random.default_rng(10), 120, 160).save(buf, "JPEG", quality=90, progressive=True)
    src = buf.getvalue()
    out, i = bytearray(src[:2]), 2  # segment by segment, leaving out the scans with Ah != 0 (refinements)
    while src[i + 1] != 0xD9:
        end = i + 2 + struct.unpack_from(">H", src, i + 2)[0]
        if src[i + 1] != 0xDA:
            out += src[i:end]
            i = end
            continue
        j = end
        while not (src[j] == 0xFF and src[j + 1] not in (0x00, *range(0xD0, 0xD8))):
            j += 1
        ns = src[i + 4]
        if src[i + 5 + 2 * ns + 2] >> 4 == 0:
            out += src[i:j]
        i = j
    data = bytes(out + b"\xff\xd9")
    assert len(data) < len(src) and decode(data).shape == (120, 160, 3)
    assert restart_transcode(data) is None


@pytest.mark.parametrize("rewrite", [False, True])
def test_one_pixel_wide_regions_at_the_edges(jpegregion, turbojpeg, rewrite):
    """Cropped to one or two columns, 4:2:0 chroma would be 1 sample wide, which libjpeg upsamples without its
    fancy filter: the crop is kept at least an iMCU wide."""
    rng = np.random.default_rng(11)
    for shape in ((64, 90), (50, 33)):
        data = jpeg_bytes(rng, *shape)
        data = restart_transcode(data) if rewrite else data
        full = decode(data)
        h, w = shape
        for left in (0, 1, 2, w - 3, w - 2, w - 1):
            for width in (1, 2):
                if left + width <= w:
                    got = decode_region(data, 1, 0, left, h, width, shape)
                    assert got is not None and np.array_equal(got, full[:, left:left + width]), (shape, left, width)


def test_a_header_claiming_more_mcus_than_the_data_holds_allocates_nothing_for_them(jpegregion):
    """A 200-byte grayscale JPEG (DRI 1) claiming 13000x13000 pixels, within the pixel limit: 2.6 million MCUs
    the data can't hold. The region decoder must not allocate for them (8 MB of address space to spare, run
    apart): the original's decode then says what is wrong."""
    code = """if True:
        import resource, struct
        from packer.images.jpegregion import decode_region
        def seg(m, p): return bytes([0xFF, m]) + struct.pack(">H", len(p) + 2) + p
        H = W = 13000
        jpeg = (b"\\xff\\xd8" + seg(0xDB, b"\\0" + bytes([1] * 64))
                + seg(0xC0, b"\\x08" + struct.pack(">HH", H, W) + b"\\x01\\x01\\x11\\x00")
                + seg(0xC4, b"\\x00" + bytes([1] + [0] * 15) + b"\\x00")
                + seg(0xC4, b"\\x10" + bytes([1] + [0] * 15) + b"\\x00")
                + seg(0xDD, b"\\x00\\x01") + seg(0xDA, b"\\x01\\x01\\x00\\x00\\x3f\\x00")
                + b"\\x00\\xff\\xd0\\x00\\xff\\xd9")
        used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + (8 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
        try:
            decode_region(jpeg, 1, H - 8, W - 8, 8, 8, (H, W))
            print("decoded")
        except Exception as exc:
            print(type(exc).__name__, exc)
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-500:]
    assert run.stdout.startswith("DecodeError") and "out of memory" not in run.stdout, run.stdout
