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
