import io

import numpy as np
import pytest
from PIL import Image
from support.imagesets import jpeg_bytes

from packer.images.decode import DecodeError
from packer.images.headers import image_size


@pytest.mark.parametrize("kw", [{}, {"progressive": True}, {"subsampling": 0},
                                {"exif": b"Exif\x00\x00" + b"\x00" * 64}])
def test_jpeg_size_matches_pillow(kw):
    rng = np.random.default_rng(3)
    data = jpeg_bytes(rng, 37, 53, **kw)
    assert image_size(data) == (37, 53)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "P", "L", "I;16"])
def test_png_and_others_match_pillow(mode):
    buf = io.BytesIO()
    Image.new(mode, (41, 17)).save(buf, format="PNG")
    assert image_size(buf.getvalue()) == (17, 41)
    buf = io.BytesIO()
    Image.new("RGB", (41, 17)).save(buf, format="BMP")
    assert image_size(buf.getvalue()) == (17, 41)


def test_damaged_headers_are_decode_errors():
    rng = np.random.default_rng(4)
    data = jpeg_bytes(rng, 20, 20)
    for bad in (data[:40], b"\xff\xd8\xff\xe0\x00\x01", b"\x89PNG\r\n\x1a\n\x00", rng.bytes(100)):
        with pytest.raises(DecodeError):
            image_size(bad)


def _with_fill_and_standalone(data: bytes) -> bytes:
    """The same JPEG with fill bytes and a TEM marker before its first segment after SOI (both legal)."""
    return data[:2] + b"\xff\xff\xff\x01" + data[2:]


def test_one_walker_serves_sizes_metadata_and_tiles():
    # decode.jpeg_markers is the header walker under jpeg_size, jpeg_segments (verify) and scan_start (mosaic
    # tiles): fill bytes and standalone markers are skipped alike, and each sees the same segments
    from packer.images.decode import jpeg_markers
    from packer.images.headers import jpeg_segments
    from packer.images.jpegtiles import scan_start

    rng = np.random.default_rng(5)
    plain = jpeg_bytes(rng, 24, 40, exif=b"Exif\x00\x00" + b"\x00" * 16)
    padded = _with_fill_and_standalone(plain)
    assert [m for _, m, _ in jpeg_markers(padded)] == [m for _, m, _ in jpeg_markers(plain)]
    assert [m for _, m, _ in jpeg_markers(plain)][-1] == 0xDA  # through the first scan, not beyond
    assert image_size(padded) == image_size(plain) == (24, 40)
    assert jpeg_segments(padded) == jpeg_segments(plain)
    assert (0xE1, b"Exif\x00\x00" + b"\x00" * 16) in jpeg_segments(plain)
    sof, start = scan_start(padded, "x.jpg")
    assert padded[sof:sof + 2] == b"\xff\xc0" and start == len(padded) - len(plain) + scan_start(plain, "x.jpg")[1]


def test_walker_damage_is_named_by_each_caller():
    from packer.errors import PackerError
    from packer.images.headers import jpeg_segments
    from packer.images.jpegtiles import scan_start

    rng = np.random.default_rng(6)
    data = jpeg_bytes(rng, 16, 16)
    pos = 4 + int.from_bytes(data[4:6], "big")  # where the segment after APP0 starts
    broken = data[:pos] + b"\x00" + data[pos + 1:]  # no marker there
    for call in (image_size, jpeg_segments):
        with pytest.raises(DecodeError, match=f"no marker at byte {pos}"):
            call(broken)
    with pytest.raises(PackerError, match="t.jpg: corrupt JPEG header"):
        scan_start(broken, "t.jpg")
    eoi_first = b"\xff\xd8\xff\xd9" + data[2:]  # EOI before any frame: the walk ends there
    with pytest.raises(DecodeError, match="no frame header"):
        image_size(eoi_first)
    with pytest.raises(DecodeError, match="ends before its scan"):
        jpeg_segments(eoi_first)
    short = data[:2] + b"\xff\xe0\x00\x01" + data[2:]  # a segment length below 2
    with pytest.raises(DecodeError, match="segment length 1"):
        image_size(short)


def test_a_frame_header_too_short_and_a_scan_header_past_the_data_are_refused():
    # review: jpeg_size read a size out of the bytes after a 3-byte SOF, and scan_start returned a scan start
    # beyond the data for an SOS whose length ran past it
    from packer.errors import PackerError
    from packer.images.jpegtiles import scan_start

    short_sof = b"\xff\xd8\xff\xc0\x00\x03\x08\xff\xc4\x00\x10\x00\x20" + b"\x00" * 16
    with pytest.raises(DecodeError, match="frame header of 3 bytes"):
        image_size(short_sof)
    rng = np.random.default_rng(7)
    data = jpeg_bytes(rng, 16, 16)
    sof, start = scan_start(data, "t.jpg")
    sos = data.rindex(b"\xff\xda", 0, start)
    with pytest.raises(PackerError, match="scan header runs past the data"):
        scan_start(data[:sos] + b"\xff\xda\xff\xff", "t.jpg")
