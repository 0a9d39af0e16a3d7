"""Decoders: equal to Pillow's convert("RGB"), decode-time downscaling, fallback, workers, benchmark.

All images are real encoder output (Pillow's libjpeg-turbo, libturbojpeg's own encoder for
YCCK), generated here at odd sizes so partial MCUs at the edges are covered.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.imagesets import jpeg_bytes
from support.spawned import Fetch, batches_of, probe_for

import packer.images.decode as dec
from packer import convert, open_dataset
from packer.cli import main as cli_main
from packer.errors import PackerError
from packer.images.decode import DecodeError, decode, decode_into, decode_pil, scale_denominator, scaled_shape
from packer.images.magic import sniff
from packer.perprocess import PerProcess
from packer.tools.sample import photo_like

# Largest per-pixel difference allowed between libjpeg-turbo (system libturbojpeg via PyTurboJPEG)
# and Pillow (its bundled libjpeg-turbo) on the same JPEG. Both run libjpeg-turbo's accurate
# integer IDCT and fancy upsampling, which are bit-exact across versions and SIMD paths, so the
# bound is 0 at full size and also for DCT-downscaled decodes (scaling_factor vs draft()).
MAX_DIFF_FULL = 0
MAX_DIFF_SCALED = 0

QUALITIES = (50, 75, 95)
SUBSAMPLINGS = {"4:4:4": 0, "4:2:2": 1, "4:2:0": 2}


def photo(h: int = 67, w: int = 91, seed: int = 0) -> Image.Image:
    return photo_like(np.random.default_rng(seed), h, w)


def jpeg(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **kw)
    return buf.getvalue()


def png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def png_rgb16(arr: np.ndarray) -> bytes:
    """A 48-bit RGB PNG (Pillow reads these but cannot write them): minimal, valid encoder."""
    h, w, _ = arr.shape

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    rows = b"".join(b"\x00" + arr[y].astype(">u2").tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def pillow_rgb(data: bytes) -> np.ndarray:
    """The reference: what torchvision's ImageFolder loader gives."""
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def max_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def check_rgb(out: np.ndarray, h: int, w: int) -> None:
    assert out.dtype == np.uint8 and out.shape == (h, w, 3)


# ------------------------------------------------------------------ exactness vs Pillow

@pytest.mark.parametrize("progressive", [False, True], ids=["baseline", "progressive"])
@pytest.mark.parametrize("sub", list(SUBSAMPLINGS))
def test_turbojpeg_matches_pillow(turbojpeg, sub, progressive):
    img = photo()
    for q in QUALITIES:
        data = jpeg(img, quality=q, subsampling=SUBSAMPLINGS[sub], progressive=progressive)
        ref = pillow_rgb(data)
        out = dec.decode_turbojpeg(data)
        assert out is not None, "libjpeg-turbo should decode this JPEG itself"
        check_rgb(out, 67, 91)
        assert max_diff(out, ref) <= MAX_DIFF_FULL, f"q{q} {sub}"
        assert max_diff(decode(data, "auto"), ref) <= MAX_DIFF_FULL
        assert max_diff(decode(data, "pil"), ref) == 0


def test_grayscale_jpeg_becomes_rgb(turbojpeg):
    data = jpeg(photo().convert("L"), quality=85)
    out = dec.decode_turbojpeg(data)
    check_rgb(out, 67, 91)
    assert max_diff(out, pillow_rgb(data)) <= MAX_DIFF_FULL
    assert (out[..., 0] == out[..., 2]).all()


def test_cmyk_and_ycck_jpegs_go_to_pillow(turbojpeg):
    import turbojpeg as tjmod

    cmyk = jpeg(photo().convert("CMYK"), quality=90)  # Adobe CMYK, as Photoshop writes them
    ycck = turbojpeg.encode(np.asarray(photo().convert("CMYK")), quality=90, pixel_format=tjmod.TJPF_CMYK,
                            jpeg_subsample=tjmod.TJSAMP_420)
    for data, colorspace in ((cmyk, tjmod.TJCS_CMYK), (ycck, tjmod.TJCS_YCCK)):
        assert turbojpeg.decode_header(data)[3] == colorspace
        assert dec.decode_turbojpeg(data) is None  # not safe: Pillow's job
        for backend in ("auto", "turbojpeg", "pil"):
            out = decode(data, backend)
            check_rgb(out, 67, 91)
            assert max_diff(out, pillow_rgb(data)) == 0


@pytest.mark.parametrize("kind", ["L", "LA", "RGBA", "P", "P+transparency", "1", "I;16", "RGB48"])
def test_png_variants_equal_pillow(kind):
    rgb = photo()
    if kind == "RGB48":
        low = (np.arange(91, dtype=np.uint16) * 3 % 256)[:, None]  # the low byte varies
        arr = np.asarray(rgb).astype(np.uint16) * 256 + low
        data = png_rgb16(arr)
    elif kind == "I;16":
        data = png(Image.fromarray(np.asarray(rgb.convert("L")).astype(np.uint16) * 200))
    elif kind == "P+transparency":
        data = png(rgb.quantize(64), transparency=3)
    elif kind == "RGBA":
        rgba = rgb.convert("RGBA")
        rgba.putalpha(Image.fromarray(np.tile(np.arange(91, dtype=np.uint8) * 2, (67, 1))))
        data = png(rgba)
    elif kind == "P":
        data = png(rgb.quantize(200))
    else:
        data = png(rgb.convert(kind))
    assert sniff(data) == "png"
    for backend in ("auto", "turbojpeg", "pil"):
        out = decode(data, backend)
        check_rgb(out, 67, 91)
        assert max_diff(out, pillow_rgb(data)) == 0


def test_format_is_sniffed_not_named(tmp_path):
    data = png(photo())
    assert sniff(data) == "png" and sniff(jpeg(photo())) == "jpeg" and sniff(b"garbage") == "unknown"
    (tmp_path / "png_named.JPEG").write_bytes(data)
    assert max_diff(decode((tmp_path / "png_named.JPEG").read_bytes()), pillow_rgb(data)) == 0


def test_damaged_jpeg_is_a_decode_error(turbojpeg):
    data = jpeg(photo(), quality=90)
    for bad in (data[: len(data) // 2], b"\xff\xd8\xff" + os.urandom(300)):
        for backend in ("auto", "pil"):
            with pytest.raises(DecodeError):
                decode(bad, backend, strict=True)


def test_unknown_backend():
    with pytest.raises(PackerError, match="unknown decoder"):
        decode(jpeg(photo()), "opencv")


# ------------------------------------------------------------------ decode-time downscaling

def test_scale_denominator_is_the_smallest_scale_keeping_the_short_side():
    assert scale_denominator(375, 500, None) == 1
    assert scale_denominator(375, 500, 224) == 1  # 1/2 would give 188 < 224
    assert scale_denominator(375, 500, 188) == 2  # ceil(375 / 2) = 188
    assert scale_denominator(375, 500, 189) == 1
    assert scale_denominator(1000, 1500, 224) == 4  # 250; 1/8 would give 125
    assert scale_denominator(4000, 3000, 224) == 8
    assert scale_denominator(3, 9, 1) == 2  # never a scale larger than the short side
    for h in range(1, 70):
        for s in (1, 2, 7, 16, 33):
            d = scale_denominator(h, 2 * h + 1, s)
            got = scaled_shape(h, 2 * h + 1, s)[0]
            assert got == -(-h // d)
            assert d == 1 or got >= s  # still >= S ...
            assert d == 8 or 2 * d > h or -(-h // (2 * d)) < s  # ... and the next scale would not be


@pytest.mark.parametrize("sub", list(SUBSAMPLINGS))
def test_downscaled_decodes_agree_between_backends(turbojpeg, sub):
    h, w = 203, 151
    img = photo(h, w, seed=3)
    for q in QUALITIES:
        for progressive in (False, True):
            data = jpeg(img, quality=q, subsampling=SUBSAMPLINGS[sub], progressive=progressive)
            for s in (1, 19, 20, 26, 38, 51, 76, 102, 151, 500):
                shape = scaled_shape(h, w, s)
                tj_out = dec.decode_turbojpeg(data, min_size=s)
                pil_out = decode(data, "pil", min_size=s)
                check_rgb(tj_out, *shape)
                check_rgb(pil_out, *shape)
                assert min(shape) >= min(s, min(h, w))
                assert max_diff(tj_out, pil_out) <= MAX_DIFF_SCALED, f"q{q} {sub} S={s}"
                assert max_diff(decode(data, "auto", min_size=s), pil_out) <= MAX_DIFF_SCALED


def test_downscaling_is_real_and_non_jpeg_stay_full_size(turbojpeg):
    img = photo(160, 240)
    data = jpeg(img, quality=90)
    small = decode(data, "auto", min_size=40)
    assert small.shape == (40, 60, 3)  # 1/4
    # A downscaled decode is close to (not equal to) a resized full decode: a sanity check of content.
    ref = np.asarray(Image.fromarray(pillow_rgb(data)).resize((60, 40), Image.BOX))
    assert np.abs(small.astype(int) - ref).mean() < 4
    for other in (png(img), png(img.convert("P"))):
        assert decode(other, "auto", min_size=40).shape == (160, 240, 3)
    for kind in ("L", "CMYK"):  # Pillow-decoded JPEGs downscale the same way
        data = jpeg(img.convert(kind), quality=90)
        assert decode(data, "auto", min_size=40).shape == decode(data, "pil", min_size=40).shape == (40, 60, 3)


# ------------------------------------------------------------------ missing libturbojpeg

@pytest.fixture
def no_turbojpeg(monkeypatch):
    """This process, as if libturbojpeg were not installed: the loader fails as ctypes would."""
    def missing():
        raise OSError("libturbojpeg.so.0: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(dec, "_load_turbojpeg", missing)
    monkeypatch.setattr(dec, "_TURBO", PerProcess(dec._turbo_state))  # a handle not loaded yet in this process
    monkeypatch.setattr(dec, "_notice_shown", False)
    yield
    monkeypatch.undo()


def test_missing_library_falls_back_to_pillow_with_one_notice(no_turbojpeg, caplog):
    data = jpeg(photo(), quality=90)
    assert dec.turbojpeg_handle() is None and not dec.turbojpeg_available()
    assert "cannot open shared object" in dec.turbojpeg_missing_reason()
    for _ in range(3):
        assert max_diff(decode(data, "auto"), pillow_rgb(data)) == 0
    assert decode(data, "auto", min_size=30).shape == decode_pil(data, min_size=30).shape == (34, 46, 3)
    err = caplog.text  # a warning of logging.getLogger("packer")
    assert err.count("libjpeg-turbo not found") == 1
    assert "apt-get install libturbojpeg0" in err and "cannot open shared object" in err
    with pytest.raises(PackerError, match="libturbojpeg is missing"):
        decode(data, "turbojpeg")


def test_require_turbojpeg_fails_instead_of_skipping(no_turbojpeg):
    from conftest import turbojpeg_or_skip

    with pytest.raises(pytest.skip.Exception, match="libturbojpeg did not load"):
        turbojpeg_or_skip(required=False)
    with pytest.raises(pytest.fail.Exception, match="--require-turbojpeg"):
        turbojpeg_or_skip(required=True)


def test_missing_library_through_a_dataset(packed, no_turbojpeg, caplog):
    path, refs = packed
    ds = open_dataset(path, image="numpy")
    for i in range(len(ds)):
        assert max_diff(ds[i][0], refs[ds.relpaths[i]]) == 0
    assert caplog.text.count("libjpeg-turbo not found") == 1


# ------------------------------------------------------------------ datasets and workers

@pytest.fixture
def packed(tmp_path):
    return pack_mixed(tmp_path)


def pack_mixed(tmp_path: Path) -> tuple[Path, dict]:
    """An LMDB of mixed real images (JPEG 4:2:0/4:4:4/progressive/gray/CMYK, PNGs, a PNG named .jpg), and the
    pixels Pillow decodes from each file."""
    src = tmp_path / "imgs"
    files = {
        "a/q90.jpg": jpeg(photo(120, 90, 1), quality=90),
        "a/q60_444.jpg": jpeg(photo(77, 130, 2), quality=60, subsampling=0),
        "a/prog.jpg": jpeg(photo(100, 100, 3), quality=80, progressive=True),
        "b/gray.jpg": jpeg(photo(90, 64, 4).convert("L"), quality=85),
        "b/cmyk.jpg": jpeg(photo(64, 96, 5).convert("CMYK"), quality=85),
        "b/png_named.jpg": png(photo(50, 70, 6).convert("RGBA")),
        "b/pal.png": png(photo(50, 60, 7).quantize(32)),
    }
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    out = tmp_path / "imgs.lmdb"
    res = convert(src, out, to="lmdb", workers=0, progress=False)
    assert res.num_samples == len(files) and not res.errors
    return out, {rel: pillow_rgb(data) for rel, data in files.items()}


def test_dataset_decode_size(packed):
    path, refs = packed
    full = open_dataset(path, image="numpy")
    small = open_dataset(path, image="numpy", decode_size=30)
    tensor = open_dataset(path, image="tensor", decode_size=30)
    assert full.decode_size is None
    for i, rel in enumerate(full.relpaths):
        assert max_diff(full[i][0], refs[rel]) == 0  # off by default: exact
        h, w = refs[rel].shape[:2]
        arr = small[i][0]
        want = scaled_shape(h, w, 30) if rel.endswith(".jpg") and rel != "b/png_named.jpg" else (h, w)
        assert arr.shape == (*want, 3), rel
        assert max_diff(arr, decode(small.read_payload(i), "pil", min_size=30)) == 0
        assert tuple(tensor[i][0].shape) == (3, *want)
    batch = small.__getitems__([3, 0, 6])
    assert [a.shape for a, _ in batch] == [small[i][0].shape for i in (3, 0, 6)]
    for bad in (0, -5, 2.5, "224", True):
        with pytest.raises(PackerError, match="decode size"):
            open_dataset(path, decode_size=bad)


def handle_pids(img):
    """Transform run in DataLoader workers: (worker pid, pid that loaded this process's TurboJPEG handle), pixels."""
    dec.turbojpeg_handle()
    return os.getpid(), dec._TURBO._pid, img


@pytest.mark.parametrize("ctx,decode_size", [("fork", None), ("spawn", 30)])
def test_workers_decode_with_their_own_handle(turbojpeg, request, ctx, decode_size):
    from torch.utils.data import DataLoader

    if ctx == "spawn":  # read by the session's spawned workers (_spawned_decode)
        out = request.getfixturevalue("spawned")
        path, refs = out.context
        ds = open_dataset(path, image="numpy", decode_size=decode_size)
        got = [item for batch in out.values() for item in batch]
    else:
        path, refs = request.getfixturevalue("packed")
        decode(jpeg(photo()), "auto")  # the parent holds a handle before forking
        ds = open_dataset(path, image="numpy", decode_size=decode_size, transform=handle_pids)
        ds[0]  # and has read from the dataset
        loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=ctx, collate_fn=list)
        got = [item for batch in loader for item in batch]
    assert len(got) == len(ds)
    pids = {pid for (pid, _, _), _ in got}
    assert os.getpid() not in pids and all(pid == loaded for (pid, loaded, _), _ in got)
    for i, ((_, _, arr), _label) in enumerate(got):
        rel = ds.relpaths[i]
        want = decode(ds.read_payload(i), "pil", min_size=decode_size)  # Pillow, at the same DCT scale
        assert max_diff(arr, want) == 0, rel
        if decode_size is None:
            assert max_diff(arr, refs[rel]) == 0


@probe_for(test_workers_decode_with_their_own_handle)
def _spawned_decode(tmp_path_factory):
    """Batches of 2 read at decode size 30 by spawned workers, a dataset the parent has read from."""
    path, refs = pack_mixed(tmp_path_factory.mktemp("decode"))
    ds = open_dataset(path, image="numpy", decode_size=30, transform=handle_pids)
    ds[0]
    return Fetch(ds, batches_of(len(ds), 2)), (path, refs)


def test_require_turbojpeg_option(request):
    """With --require-turbojpeg (CI, or libturbojpeg installed), the library must load."""
    if not request.config.getoption("--require-turbojpeg"):
        pytest.skip("only with --require-turbojpeg")
    assert dec.turbojpeg_available(), f"libturbojpeg did not load: {dec.turbojpeg_missing_reason()}"


# ------------------------------------------------------------------ benchmark

def test_measure_decoders_structure(packed, tmp_path):
    from packer.diagnose.decoders import available_backends, measure_decoders
    from packer.diagnose.measure import load_samples

    path, refs = packed
    samples = load_samples(path, limit=100)
    ds = open_dataset(path)
    assert sorted(samples) == sorted(bytes(ds.read_payload(i)) for i in range(len(ds)))
    folder_samples = load_samples(tmp_path / "imgs", limit=3)
    assert len(folder_samples) == 3
    backends = [b for b in available_backends() if b != "simplejpeg"]
    jpegs = [s for s in samples if sniff(s) == "jpeg" and Image.open(io.BytesIO(s)).mode != "CMYK"]
    res = measure_decoders(jpegs, backends=backends, sizes=(None, 30), seconds=0.01)
    assert [(r["backend"], r["decode_size"]) for r in res] == [(b, s) for b in backends for s in (None, 30)]
    for r in res:
        assert r["images"] >= len(jpegs) and r["images"] % len(jpegs) == 0
        assert r["img_per_s"] > 0 and r["src_mp_per_s"] >= r["out_mp_per_s"] > 0
        shapes = [decode(s, "pil", min_size=r["decode_size"]).shape for s in jpegs]
        assert r["mean_out_hw"] == [pytest.approx(np.mean([s[0] for s in shapes])),
                                    pytest.approx(np.mean([s[1] for s in shapes]))]
    with pytest.raises(PackerError, match="not available"):
        measure_decoders(jpegs, backends=["nvjpeg"], seconds=0.01)


def test_cli_bench_decoders(turbojpeg, packed, tmp_path, capsys):
    path, _ = packed
    out = tmp_path / "dec.json"
    assert cli_main(["bench", "--decoders", str(path), "--limit", "4", "--seconds", "0.01",
                     "--sizes", "full,40", "--backends", "turbojpeg,pil", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "img/s/core" in text and "vs bare libjpeg-turbo" in text
    doc = json.loads(out.read_text())
    assert doc["samples"] == 4 and len(doc["decoders"]) == 4
    assert set(doc["overhead"]["img_per_s"]) == {"bare", "packer", "packer_item", "bare_held", "packer_held"}
    assert doc["overhead"]["ratio"] == pytest.approx(doc["overhead"]["img_per_s"]["packer"]
                                                     / doc["overhead"]["img_per_s"]["bare"])
    assert cli_main(["bench"]) == 2  # no PATH and no --decoders: usage
    assert "at least one PATH" in capsys.readouterr().err
    assert cli_main(["bench", "--decoders", str(path), str(path)]) == 2


@pytest.mark.parametrize("fmt, mode", [("JPEG", "RGB"), ("JPEG", "CMYK"), ("PNG", "RGBA")])
def test_decode_into_a_given_array(fmt, mode):
    """``out`` of the image's shape receives the pixels (libjpeg-turbo writes in place, others are copied);
    a wrong shape leaves it untouched and returns a new array."""
    buf = io.BytesIO()
    photo_like(np.random.default_rng(3), 21, 34, 2).convert(mode).save(buf, format=fmt)
    data = buf.getvalue()
    expected = decode_pil(data)
    out = np.zeros((21, 34, 3), dtype=np.uint8)
    got = decode(data, out=out)
    assert got is out and np.array_equal(out, expected)
    wrong = np.zeros((20, 34, 3), dtype=np.uint8)
    got = decode(data, out=wrong)
    assert got is not wrong and not wrong.any() and np.array_equal(got, expected)


def test_libjpeg_turbo_writes_into_out_itself(turbojpeg, monkeypatch):
    """No copy for JPEGs: without the compiled extension, PyTurboJPEG is handed ``out`` as its destination."""
    monkeypatch.setattr(dec, "_native", None)
    buf = io.BytesIO()
    photo_like(np.random.default_rng(4), 21, 34, 2).save(buf, format="JPEG")
    given = []
    real = turbojpeg.decode

    def spy(*args, **kwargs):
        given.append(kwargs.get("dst"))
        return real(*args, **kwargs)

    monkeypatch.setattr(turbojpeg, "decode", spy)
    out = np.zeros((21, 34, 3), dtype=np.uint8)
    assert decode(buf.getvalue(), out=out) is out
    assert len(given) == 1 and given[0] is out


JPEG_KINDS = {"420": {"subsampling": 2}, "422": {"subsampling": 1}, "444": {"subsampling": 0},
              "progressive": {"progressive": True}, "restart-markers": {"restart_marker_blocks": 3}}


@pytest.mark.parametrize("kind", sorted(JPEG_KINDS) + ["grayscale"])
@pytest.mark.parametrize("shape", [(375, 500), (61, 97), (1, 1)])
def test_whole_decode_into_out_is_pillows_pixels(jpegregion, turbojpeg, monkeypatch, kind, shape):
    """The compiled extension decodes whole JPEGs into ``out`` without PyTurboJPEG (a spy sees no call): the
    pixels are Pillow's and PyTurboJPEG's, for every JPEG kind."""
    img = photo_like(np.random.default_rng(len(kind) + shape[0]), *shape, 3)
    buf = io.BytesIO()
    (img.convert("L") if kind == "grayscale" else img).save(buf, format="JPEG", quality=90, **JPEG_KINDS.get(kind, {}))
    data = buf.getvalue()
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(decode(data), want)  # PyTurboJPEG into a new array
    calls = []
    monkeypatch.setattr(turbojpeg, "decode", lambda *a, **k: calls.append(1))
    out = np.zeros((*shape, 3), np.uint8)
    assert decode_into(data, "auto", True, out) is out and np.array_equal(out, want)
    out[:] = 0
    assert decode(data, out=out) is out and np.array_equal(out, want) and not calls


def test_whole_decode_into_leaves_what_it_cannot_to_the_other_paths(jpegregion, turbojpeg):
    rng = np.random.default_rng(9)
    data = jpeg_bytes(rng, 40, 60)
    want = decode(data)
    assert decode_into(data, "pil", True, np.zeros((40, 60, 3), np.uint8)) is None  # the backend asked for
    for out in (np.zeros((40, 59, 3), np.uint8), np.zeros((40, 60, 3), np.uint8)[:, ::-1],
                np.zeros((40, 60, 4), np.uint8), np.zeros((40, 60, 3), np.int16), np.zeros((1, 70000, 3), np.uint8)):
        assert decode_into(data, "auto", True, out) is None and not out.any()  # not the image's shape or layout
    readonly = np.zeros((40, 60, 3), np.uint8)
    readonly.flags.writeable = False
    assert decode_into(data, "auto", True, readonly) is None
    png = io.BytesIO()
    Image.fromarray(want).save(png, format="PNG")
    assert decode_into(png.getvalue(), "auto", True, np.zeros((40, 60, 3), np.uint8)) is None
    cmyk = io.BytesIO()
    Image.fromarray(want).convert("CMYK").save(cmyk, format="JPEG")
    out = np.zeros((40, 60, 3), np.uint8)
    assert decode_into(cmyk.getvalue(), "auto", True, out) is None
    assert decode(cmyk.getvalue(), out=out) is out  # Pillow's conversion, as before
    assert np.array_equal(out, np.asarray(Image.open(io.BytesIO(cmyk.getvalue())).convert("RGB")))


def test_whole_decode_into_out_strict_and_damaged(jpegregion, turbojpeg, monkeypatch):
    """Truncated bytes: an error when strict, else what PyTurboJPEG gives (libjpeg fills the missing rows); a
    header above the pixel limit is refused before decoding."""
    data = jpeg_bytes(np.random.default_rng(10), 240, 320)
    half = data[:len(data) // 2]
    out = np.zeros((240, 320, 3), np.uint8)
    with pytest.raises(DecodeError, match="cannot decode JPEG"):
        decode(half, strict=True, out=out)
    with pytest.raises(DecodeError, match="cannot decode JPEG"):
        decode(data[:-2], strict=True, out=out)  # all rows there, no end marker: a warning at the end
    loose = decode(half, strict=False, out=out)
    monkeypatch.setattr(dec, "_native", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert loose is out and np.array_equal(out, decode(half, strict=False))
    monkeypatch.undo()
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)
    with pytest.raises(DecodeError, match="pixel limit of 8000 .2 x PIL.Image.MAX_IMAGE_PIXELS"):
        decode(data, out=out)  # the same words as every other decode path


def test_whole_decode_into_out_reads_to_the_end_marker(jpegregion, turbojpeg, monkeypatch):
    """An error after the last row (a marker damaged after the scan) is an error even when not strict, as in a
    whole decode through PyTurboJPEG, and with the same words."""
    good = jpeg_bytes(np.random.default_rng(11), 48, 64)
    good = good[:-2] + b"\xff\xfe\x00\x10a comment here" + good[-2:]  # a COM segment after the scan: valid
    bad = good.replace(b"\xff\xfe\x00\x10", b"\xff\xc0\x00\x10")  # that marker damaged into a second SOF
    out = np.zeros((48, 64, 3), np.uint8)
    assert decode(good, strict=False, out=out) is out
    with pytest.raises(DecodeError, match="two SOF markers") as new:
        decode(bad, strict=False, out=out)
    monkeypatch.setattr(dec, "_native", None)
    with pytest.raises(DecodeError) as old, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decode(bad, strict=False, out=out)
    assert str(new.value) == str(old.value)


@pytest.mark.parametrize("height", [b"\xff\xff", b"\xfb\xb8"])  # beyond libjpeg's 65500; above the pixel limit
def test_damaged_header_size_is_named_as_such_before_any_decoder(tmp_path, height, jpegregion):
    """A packed sample whose header's height was damaged on disk: the index's check words it, whichever decoder
    would run next (the compiled one reads the header itself, with other words)."""
    import packer

    (tmp_path / "src" / "a").mkdir(parents=True)
    data = jpeg_bytes(np.random.default_rng(12), 48, 3000)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(data)
    convert(tmp_path / "src", tmp_path / "ds", to="memmap", workers=0, progress=False)
    shard = next((tmp_path / "ds").glob("shard-*.bin"))
    blob = bytearray(shard.read_bytes())
    at = blob.find(data) + data.find(b"\xff\xc0") + 5  # the SOF's height
    blob[at:at + 2] = height
    shard.write_bytes(bytes(blob))
    ds = open_dataset(tmp_path / "ds", image="tensor")
    want = f"image header says {int.from_bytes(height, 'big')}x3000, the index says 48x3000 (damaged)"
    with pytest.raises(DecodeError, match=re.escape(want)):
        ds.pixels(0, out=np.zeros((48, 3000, 3), np.uint8))
    with pytest.raises(DecodeError, match=re.escape(want)):
        next(iter(packer.ThreadLoader(ds, batch_size=1, num_threads=1)))


# A fuzzed 74x27 JPEG (a marker's length damaged): PyTurboJPEG, not strict, handed back uninitialised memory for it
# (different pixels on each call); libjpeg through the extension and Pillow refuse it.
BOGUS_MARKER_LENGTH = base64.b64decode(
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAMCAgMCAgMDAwMEAwMEBQgFBQQEBQoHBwYIDAoMDAsKCwsNDhIQDQ4RDgsLEBYQERMU"
    "FRUVDA8XGBYUGBIUFRT/2wBDAQMEBAUEBQkFBQkUDQsNFBQUFBQUFBQUFBRUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFBQU"
    "FBQUFBQUFBT/wgARCABKABsDASIAAhEBAxEB/8QAFwABAQEBAAAAAAAAAAAAAAAABgcEBf/EABcBAAMBAAAAAAAAAAAAAAAAAAQF"
    "Bgf/2gAMAwEAAhADEAAAAS6OhKQI0FtrPQfah//EABwQAAIBBQEAAAAAAAAAAAAAAAECAAMEBhEhFv/aAAgAAQABBQKhjnbXGgZR"
    "xvc84ktUWW6gygNo3D//xAAaEQACAgMAAAAAAAAAAAAAAAABBAAFAhEx/9oACAEDAQE/Aa2/ZB1FL1oYdn//xAAbEQACAQUAAAAA"
    "AAAAAAAAAAAABAMBAgURMf/aAAgBAgEBPwFZqXXRfIS0tP/EACEQAAECBAcAAAAAAAAAAAAAAAABAhESISIDEDEycpHw/9oACAEB"
    "AAY/Aki202doRll9qVwq8hbUGUG5f//EAB8QAQABBAIDAQAAAAAAAAAAAAERACExQVFhcYHw8f/aAAgBAQABPyHUgRIMvP34aE5G"
    "Vl1RNU5JLFr7UruwwKH2eKmCFjKeaCQDk9VchY6r/9oADAMBAAIAAwAAABA8b//EABsRAAICAwEAAAAAAAAAAAAAAAERAEExUWGR"
    "/9oACAEDAQE/EAQbBOdOo0N6eT//xAAaEQACAgMAAAAAAAAAAAAAAAABEaHwACFR/9oACAECAQE/EA0FKxzbcDOf/8QAHhABAQEB"
    "AAICAwAAAAAAAAAAAREhAGFxMUFRgaH/2gAIAQEAAT8Qg0Dt66D9/QRdnHaz9AHCYO6kGXzF2BXcNagSn4sLCV5cWAEmIIZCYGQ6"
    "pCV1Du52u/YF48qfOl9PXjmvdrMFdf73/9k=")


def test_corrupt_jpeg_is_an_error_not_uninitialised_pixels(jpegregion, turbojpeg):
    with pytest.raises(OSError):
        Image.open(io.BytesIO(BOGUS_MARKER_LENGTH)).convert("RGB")
    for out in (None, np.zeros((74, 27, 3), np.uint8), np.zeros((10, 10, 3), np.uint8)):  # the last: not its shape
        with pytest.raises(DecodeError, match="Bogus marker length"):
            decode(BOGUS_MARKER_LENGTH, strict=False, out=out)


def test_without_the_extension_corrupt_pixels_are_never_uninitialised(turbojpeg, monkeypatch):
    """PyTurboJPEG (the path without the extension) lets this corrupt JPEG through when not strict: what it did
    not write is zeros, the same on every call, never memory left over from elsewhere."""
    monkeypatch.setattr(dec, "_native", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = decode(BOGUS_MARKER_LENGTH, strict=False)
        np.full(first.nbytes * 64, 255, np.uint8)  # memory freed with content, for a careless allocation to reuse
        again = [decode(BOGUS_MARKER_LENGTH, strict=False) for _ in range(5)]
    assert all(np.array_equal(first, a) for a in again)


def test_decode_many_equals_decode_item_by_item(jpegregion, turbojpeg):
    """One call for many whole JPEGs (a ThreadLoader's chunk): the pixels of ``decode``, and per item whether it
    was done; what it leaves (another format, CMYK, a shape or buffer unlike the header's, damage) is untouched
    or left to ``decode``, which says what is wrong."""
    rng = np.random.default_rng(13)
    kinds = [jpeg_bytes(rng, 40, 60), jpeg_bytes(rng, 33, 17)]
    gray = io.BytesIO()
    photo_like(rng, 21, 30, 1).convert("L").save(gray, format="JPEG")
    cmyk, pngb = io.BytesIO(), io.BytesIO()
    photo_like(rng, 20, 20, 2).convert("CMYK").save(cmyk, format="JPEG")
    photo_like(rng, 20, 20, 3).save(pngb, format="PNG")
    datas = [*kinds, gray.getvalue(), cmyk.getvalue(), pngb.getvalue(), kinds[0], kinds[0][: len(kinds[0]) // 2],
             BOGUS_MARKER_LENGTH, memoryview(kinds[1])]
    outs = [np.zeros((40, 60, 3), np.uint8), np.zeros((33, 17, 3), np.uint8), np.zeros((21, 30, 3), np.uint8),
            np.zeros((20, 20, 3), np.uint8), np.zeros((20, 20, 3), np.uint8), np.zeros((40, 59, 3), np.uint8),
            np.zeros((40, 60, 3), np.uint8), np.zeros((74, 27, 3), np.uint8), np.zeros((33, 17, 3), np.uint8)]
    done = dec.decode_many(datas, outs, "auto", strict=True)
    assert list(done) == [1, 1, 1, 0, 0, 0, 2, 2, 1]
    for data, out, ok in zip(datas, outs, done, strict=True):
        if ok == 1:
            assert np.array_equal(out, decode(data)) and np.array_equal(out, pillow_rgb(bytes(data)))
        elif ok == 0:
            assert not out.any()
    assert list(dec.decode_many(datas[6:7], outs[6:7], "auto", strict=False)) == [1]  # truncated: filled in
    assert np.array_equal(outs[6], decode(datas[6], strict=False))
    assert dec.decode_many(datas, outs, "pil", strict=True) is None
    assert dec.decode_many([], [], "auto", strict=True) == b""
    odd = [np.zeros((40, 60, 3), np.uint8)[:, ::-1], np.zeros((40, 60, 4), np.uint8), np.zeros((40, 60, 3), np.int16),
           np.zeros((1, 70000, 3), np.uint8)]
    assert list(dec.decode_many([kinds[0]] * 4, odd, "auto", strict=True)) == [0, 0, 0, 0]
    assert not any(o.any() for o in odd)
    readonly = np.zeros((40, 60, 3), np.uint8)
    readonly.flags.writeable = False
    assert list(dec.decode_many([kinds[0], kinds[0]], [readonly, b"not writable"], "auto", strict=True)) == [0, 0]
    with pytest.raises(ValueError, match="differ in length"):
        dec.decode_many(datas, outs[:2], "auto", strict=True)


def test_decode_many_keeps_the_pixel_limit(jpegregion, turbojpeg, monkeypatch):
    data = jpeg_bytes(np.random.default_rng(14), 100, 100)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 4000)  # limit 8000 pixels: the image and out are above it
    out = np.zeros((100, 100, 3), np.uint8)
    assert list(dec.decode_many([data], [out], "auto", strict=True)) == [0] and not out.any()
    with pytest.raises(DecodeError, match="pixel limit of 8000"):
        decode(data, out=out)


@pytest.mark.parametrize("backend", ["auto", "turbojpeg", "pil"])
@pytest.mark.parametrize("min_size", [None, 20])
def test_a_read_only_out_is_never_written(turbojpeg, backend, min_size, tmp_path):
    """A read-only ``out`` of the right shape (a map opened for reading, a view of bytes) gets a new array back,
    unwritten: libjpeg-turbo writes through a read-only numpy array, and into a read-only map that is a crash."""
    import mmap

    data = jpeg_bytes(np.random.default_rng(11), 48, 64)
    want = decode(data, backend, min_size=min_size)
    (tmp_path / "zeros").write_bytes(bytes(want.nbytes))
    with open(tmp_path / "zeros", "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for out in (np.frombuffer(mm, np.uint8).reshape(want.shape), np.frombuffer(bytes(want.nbytes), np.uint8)
                    .reshape(want.shape)):
            got = decode(data, backend, min_size=min_size, out=out)
            assert got is not out and np.array_equal(got, want) and not out.any()
            del out
