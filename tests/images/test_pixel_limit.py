"""One pixel limit on every decode path: a 1 KB file whose header claims 65000x65000 is refused from
its header, at conversion (listed in errors.json) and when read (PackerError), never decoded.

Each risky call runs in a forked child allowed 2 GiB more address space (tests/support/memlimit.py), so a
regression fails the test instead of getting the test runner OOM-killed.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.fuzzing import _rewrite_checksums, put_lmdb_value
from support.imagesets import jpeg_bytes
from support.memlimit import limited_call

from packer import PackerError, convert, open_dataset
from packer.images import bmp as bmpfile
from packer.images.decode import check_pixels, decode, pixel_limit
from packer.images.resize import ResizeSpec
from packer.tools.verify import verify

SIDE = 65000  # 4.2 G pixels: 12.7 GB once decoded


def jpeg_bomb(rng) -> bytes:
    """A real small JPEG whose SOF0 says SIDE x SIDE."""
    data = bytearray(jpeg_bytes(rng, 24, 32))
    sof = next(i for i in range(2, len(data) - 9) if data[i] == 0xFF and data[i + 1] == 0xC0)
    data[sof + 5: sof + 9] = struct.pack(">HH", SIDE, SIDE)
    return bytes(data)


def png_bomb() -> bytes:
    """A real small PNG whose IHDR (CRC fixed) says SIDE x SIDE."""
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 30)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    struct.pack_into(">II", data, 16, SIDE, SIDE)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.fixture(scope="module")
def bombs():
    return {"jpg": jpeg_bomb(np.random.default_rng(3)), "png": png_bomb()}


def refused(result: tuple[str, str]) -> bool:
    """The child raised a PackerError (DecodeError) that names the pixel limit."""
    kind, message = result
    return kind in ("PackerError", "DecodeError") and "pixel limit" in message


# ------------------------------------------------------------------ decoders


@pytest.mark.parametrize("backend", ["auto", "turbojpeg", "pil"])
@pytest.mark.parametrize("kind", ["jpg", "png"])
def test_decoders_refuse_a_bomb_from_its_header(bombs, kind, backend, request):
    if backend == "turbojpeg":
        request.getfixturevalue("turbojpeg")
    result = limited_call(decode, bombs[kind], backend)
    assert refused(result), result


def test_the_limit_is_pillows_rule_read_at_call_time(monkeypatch):
    assert pixel_limit() == 2 * Image.MAX_IMAGE_PIXELS
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    assert pixel_limit() == 1000
    check_pixels(25, 40)
    with pytest.raises(PackerError, match="pixel limit of 1000"):
        check_pixels(25, 41)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert pixel_limit() is None
    check_pixels(SIDE, SIDE)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_every_decode_path_applies_the_same_limit(monkeypatch, turbojpeg):
    """libjpeg-turbo, Pillow, the BMP codec and resizing all refuse 41x40 under a limit of 1600 pixels."""
    rng = np.random.default_rng(5)
    small, big = jpeg_bytes(rng, 40, 40), jpeg_bytes(rng, 41, 40)
    pixels = decode(big, "pil")
    bmp = bmpfile.encode(pixels)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 800)
    for backend in ("turbojpeg", "pil"):
        assert decode(small, backend).shape == (40, 40, 3)
        with pytest.raises(PackerError, match="pixel limit of 1600"):
            decode(big, backend)
    with pytest.raises(PackerError, match="pixel limit of 1600"):
        bmpfile.decode(bmp, bmpfile.parse_header(bmp, len(bmp), "x.bmp"))
    assert bmpfile.region(bmp, bmpfile.parse_header(bmp, len(bmp), "x.bmp"), 0, 0, 40, 40).shape == (40, 40, 3)
    with pytest.raises(PackerError, match="resizing to 41x41"):
        ResizeSpec.parse("41", upscale=True).apply(decode(small, "pil"))


# ------------------------------------------------------------------ conversion


@pytest.fixture
def bomb_folder(tmp_path, bombs):
    rng = np.random.default_rng(1)
    for c in ("a", "b"):
        (tmp_path / "src" / c).mkdir(parents=True)
        (tmp_path / "src" / c / "good.jpg").write_bytes(jpeg_bytes(rng, 20, 30))
    (tmp_path / "src/a/bomb.jpg").write_bytes(bombs["jpg"])
    (tmp_path / "src/b/bomb.png").write_bytes(bombs["png"])
    return tmp_path / "src"


def _convert_and_read(src: Path, out: Path, options: dict) -> tuple[dict, dict]:
    """Convert (a worker pool of one), then read every sample: (errors.json reasons, per sample: ok or error)."""
    convert(src, out, to="lmdb", workers=1, progress=False, **options)
    errors = {e["path"]: e["reason"] for e in json.loads((out / "errors.json").read_text())["errors"]}
    ds = open_dataset(out, image="numpy")
    reads = {}
    for i, rel in enumerate(ds.relpaths):
        try:
            ds[i]
            reads[rel] = "ok"
        except PackerError as exc:
            reads[rel] = str(exc)
    return errors, reads


@pytest.mark.parametrize("options", [{"validate": "full"}, {"validate": "header"}, {"payload": "raw"}],
                         ids=["full", "header", "raw"])
def test_conversion_lists_a_bomb_in_errors_json(bomb_folder, tmp_path, options, turbojpeg):
    kind, result = limited_call(_convert_and_read, bomb_folder, tmp_path / "out", options)
    assert kind == "ok", result
    errors, reads = result
    assert set(errors) == {"a/bomb.jpg", "b/bomb.png"}, errors
    assert all("4225000000 pixels" in r and "pixel limit" in r for r in errors.values()), errors
    assert reads == {"a/good.jpg": "ok", "b/good.jpg": "ok"}


def test_a_bomb_does_not_count_in_the_space_a_raw_conversion_needs(bomb_folder, turbojpeg):
    """Images over the pixel limit are refused when converted, never written: the free-space check before a raw
    conversion leaves them out (two bombs promised 25 GB of pixels: the conversion was refused on a disk with less)."""
    from packer.write.options import ConvertOptions
    from packer.write.plan import estimate_sample_bytes
    from packer.write.scan import scan_folder

    scan = scan_folder(bomb_folder)
    assert estimate_sample_bytes(scan, ConvertOptions(format="lmdb", payload="raw")) <= 30 * 20 * 3


def test_validate_none_packs_a_bomb_unlooked_at_and_readers_refuse_it(bomb_folder, tmp_path, turbojpeg):
    kind, result = limited_call(_convert_and_read, bomb_folder, tmp_path / "out", {"validate": "none"})
    assert kind == "ok", result
    errors, reads = result
    assert errors == {}
    assert reads["a/good.jpg"] == reads["b/good.jpg"] == "ok"
    for bomb in ("a/bomb.jpg", "b/bomb.png"):
        assert "pixel limit" in reads[bomb] and bomb in reads[bomb], reads


# ------------------------------------------------------------------ reading a crafted dataset


@pytest.fixture
def crafted(imagefolder, tmp_path, bombs):
    """An encoded LMDB whose sample 3 is the JPEG bomb, its index agreeing (65000x65000), checksums recomputed."""
    ds_path = tmp_path / "ds"
    convert(imagefolder, ds_path, to="lmdb", workers=1, progress=False)
    ds = open_dataset(ds_path)
    shard, pos = ds.locate(3)
    stored = ds.position(3)  # meta/ is in storage order
    ds.close()
    put_lmdb_value(ds_path / ds.manifest.shards[shard].files[0].name, pos, bombs["jpg"])
    for name, value in (("heights", SIDE), ("widths", SIDE), ("nbytes", len(bombs["jpg"]))):
        arr = np.load(ds_path / f"meta/{name}.npy")
        arr[stored] = value
        np.save(ds_path / f"meta/{name}.npy", arr)
    _rewrite_checksums(ds_path)
    return ds_path


def _read_sample(path: Path, i: int, decoder: str) -> object:
    return open_dataset(path, image="numpy", decoder=decoder)[i][0].shape


@pytest.mark.parametrize("decoder", ["auto", "pil"])
def test_reading_a_bomb_whose_index_agrees_is_refused(crafted, decoder, turbojpeg):
    assert refused(limited_call(_read_sample, crafted, 3, decoder))
    assert limited_call(_read_sample, crafted, 2, decoder)[0] == "ok"


def _verify_deep(path: Path) -> list[str]:
    return verify(path, deep=True).problems


def test_verify_deep_reports_a_bomb_instead_of_dying(crafted, turbojpeg):
    assert verify(crafted).ok  # the checksums agree: only decoding can judge it
    kind, problems = limited_call(_verify_deep, crafted)
    assert kind == "ok", problems
    assert len(problems) == 2 and "sample 3" in problems[0] and "pixel limit" in problems[0], problems
    assert "sample 3: its payload is not the one meta/ records for ranged reads" in problems[1]  # the crafter's


def test_png_mosaics_beyond_the_limit_are_refused_before_converting(bomb_folder, tmp_path):
    """A png mosaic is read by decoding it whole: one above the limit could never be read back."""
    with pytest.raises(PackerError, match="pixel limit.*smaller grid"):
        convert(bomb_folder, tmp_path / "m", to="mosaic", tile="2240x2240", grid="10x10", codec="png",
                workers=1, progress=False)
    assert not (tmp_path / "m").exists()
