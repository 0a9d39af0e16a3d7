"""``convert --jpeg-restarts``: each YCbCr/grayscale JPEG stored rewritten with a restart marker per MCU (the same
pixels), everything else byte for byte; recorded in the manifest, checked by ``verify --against``, refused where
it cannot apply."""

from __future__ import annotations

import io
import json
import shutil
import struct

import numpy as np
import pytest
from PIL import Image
from support.imagesets import jpeg_bytes

from packer import PackerError, convert, open_dataset
from packer.cli import main
from packer.images.decode import decode
from packer.images.jpegregion import restart_transcode
from packer.tools.sample import photo_like
from packer.tools.verify import verify


def restart_interval(data: bytes) -> int | None:
    i = 2
    while data[i + 1] != 0xDA:
        (length,) = struct.unpack_from(">H", data, i + 2)
        if data[i + 1] == 0xDD:
            return struct.unpack_from(">H", data, i + 4)[0]
        i += 2 + length
    return None


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """JPEGs of several kinds, a PNG and a CMYK JPEG (kept as they are) in two classes."""
    root = tmp_path_factory.mktemp("restarts") / "imgs"
    rng = np.random.default_rng(0)
    for c, kinds in enumerate(({}, {"subsampling": 0}, {"progressive": True})):
        folder = root / f"class_{c % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(3):
            (folder / f"k{c}_{i}.jpg").write_bytes(jpeg_bytes(rng, 40 + 13 * i, 70 - 9 * i, **kinds))
    photo_like(rng, 30, 20).save(root / "class_0" / "plain.png")
    photo_like(rng, 30, 20).convert("CMYK").save(root / "class_1" / "cmyk.jpg", "JPEG")
    return root


@pytest.mark.parametrize("fmt", ["lmdb", "memmap"])
def test_jpegs_are_stored_rewritten_with_the_same_pixels(jpegregion, source, tmp_path, fmt):
    res = convert(source, tmp_path / f"ds.{fmt}", to=fmt, jpeg_restarts=True, workers=0, progress=False)
    out = res.output
    assert res.rewritten == 9 and res.num_samples == 11  # the PNG and the CMYK JPEG kept as they are
    assert json.loads((out / "manifest.json").read_text())["options"]["jpeg_restarts"] is True
    ds = open_dataset(out)
    rewritten = 0
    for i, rel in enumerate(ds.index.rel_paths()):
        original, stored = (source / rel).read_bytes(), bytes(ds.payload_at(i))
        if rel.endswith(("plain.png", "cmyk.jpg")):
            assert stored == original, rel
            continue
        rewritten += 1
        assert stored != original and restart_interval(stored) == 1, rel
        assert np.array_equal(decode(stored), decode(original)), rel
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(stored)).convert("RGB")),
                              np.asarray(Image.open(io.BytesIO(original)).convert("RGB"))), rel
    assert rewritten == 9
    assert verify(out, against=source).ok


def test_verify_reads_the_option(jpegregion, source, tmp_path):
    out = convert(source, tmp_path / "ds.lmdb", to="lmdb", jpeg_restarts=True, workers=0, progress=False).output
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["options"]["jpeg_restarts"] = False  # a manifest that says the bytes are the sources'
    (out / "manifest.json").write_text(json.dumps(manifest))
    problems = verify(out, against=source).problems
    assert len(problems) == 9 and all("stored bytes differ from the source file" in p for p in problems)
    made = convert(source, tmp_path / "plain.lmdb", to="lmdb", workers=2, progress=False)
    plain = made.output
    assert made.rewritten is None
    assert json.loads((plain / "manifest.json").read_text())["options"]["jpeg_restarts"] is False
    assert verify(plain, against=source).ok


def test_cli_flag_and_refusals(jpegregion, source, tmp_path, capsys):
    assert main(["convert", str(source), "--to", "hdf5", "-o", str(tmp_path / "a.hdf5"), "--jpeg-restarts",
                 "--workers", "2"]) == 0
    said = capsys.readouterr().out
    assert "--jpeg-restarts: 9 of 11 samples stored rewritten" in said and "2 as they were" in said
    assert json.loads((tmp_path / "a.hdf5" / "manifest.json").read_text())["options"]["jpeg_restarts"] is True
    capsys.readouterr()
    assert main(["info", str(tmp_path / "a.hdf5")]) == 0
    assert "JPEGs rewritten losslessly with a restart marker per MCU" in capsys.readouterr().out
    with pytest.raises(PackerError, match="needs payload='encoded'"):
        convert(source, tmp_path / "b.lmdb", to="lmdb", payload="raw", jpeg_restarts=True, progress=False)
    with pytest.raises(PackerError, match="jpeg_restarts must be True or False"):
        convert(source, tmp_path / "c.lmdb", to="lmdb", jpeg_restarts="yes", progress=False)
    assert main(["convert", str(source), "--to", "wds", "-o", str(tmp_path / "w"), "--jpeg-restarts", "-q"]) != 0
    assert "--jpeg-restarts: not an option of --to wds" in capsys.readouterr().err
    assert not (tmp_path / "b.lmdb").exists() and not (tmp_path / "w").exists()


def test_a_packed_dataset_converts_into_a_rewritten_one_and_back_the_same(jpegregion, source, tmp_path):
    plain = convert(source, tmp_path / "plain.lmdb", to="lmdb", order="source", workers=0, progress=False).output
    again = convert(plain, tmp_path / "again.memmap", to="memmap", order="source", jpeg_restarts=True, workers=0,
                    progress=False).output
    twice_result = convert(again, tmp_path / "twice.lmdb", to="lmdb", order="source", jpeg_restarts=True,
                           workers=0, progress=False)
    twice = twice_result.output
    assert twice_result.rewritten == 0  # rewritten again: the same bytes, so none counted as rewritten
    a, b = open_dataset(again), open_dataset(twice)
    assert [bytes(a.payload_at(i)) for i in range(len(a))] == [bytes(b.payload_at(i)) for i in range(len(b))]
    shutil.rmtree(twice)


def test_verify_takes_another_builds_rewrite_by_its_pixels(jpegregion, monkeypatch):
    """Another libjpeg may lay the rewrite out differently: verify then takes a restart-marked JPEG with the
    source's metadata and pixels, and nothing else (a PNG of the same pixels, the metadata dropped, a lossy
    re-encode, damaged bytes, a decoder that fails in its own way)."""
    import packer.tools.verify as verify_module
    from packer.tools.verify import _same_payload
    from packer.write.options import make_options

    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.open(io.BytesIO(jpeg_bytes(np.random.default_rng(1), 48, 64))).save(buf, "JPEG", quality=90,
                                                                             exif=exif.tobytes())
    source = buf.getvalue()
    rewrite = restart_transcode(source)
    dri = rewrite.index(b"\xff\xdd\x00\x04")
    moved = rewrite[:2] + rewrite[dri:dri + 6] + rewrite[2:dri] + rewrite[dri + 6:]  # DRI first: other bytes
    assert moved != rewrite and np.array_equal(decode(moved), decode(source))
    app1 = rewrite.index(b"\xff\xe1")
    no_exif = rewrite[:app1] + rewrite[app1 + 2 + struct.unpack_from(">H", rewrite, app1 + 2)[0]:]
    png, lossy = io.BytesIO(), io.BytesIO()
    Image.open(io.BytesIO(source)).save(png, "PNG")
    Image.open(io.BytesIO(source)).save(lossy, "JPEG", quality=60)
    on, off = make_options("lmdb", jpeg_restarts=True), make_options("lmdb")
    assert _same_payload(source, source, on) and _same_payload(rewrite, source, on)
    assert _same_payload(moved, source, on) and not _same_payload(moved, source, off)
    for stored in (no_exif, png.getvalue(), lossy.getvalue(), b"\xff\xd8junk", rewrite[:len(rewrite) // 2]):
        assert not _same_payload(stored, source, on)
    other_png = io.BytesIO()
    Image.open(png).save(other_png, "PNG", compress_level=0)
    assert not _same_payload(other_png.getvalue(), png.getvalue(), on)  # never rewritten: the bytes must match

    def fails(*args, **kwargs):
        raise RuntimeError("a decoder's own failure")

    monkeypatch.setattr(verify_module, "decode", fails)
    assert not _same_payload(moved, source, on)


def test_the_count_of_rewritten_samples_survives_the_journal():
    """A resumed conversion counts the samples its journaled shards rewrote; entries written before the count
    existed read as none."""
    from packer.layout.manifest import Shard
    from packer.write.journal import ShardResult

    entry = ShardResult(3, Shard(num_samples=0, files=[]), rewritten=7)
    assert ShardResult.from_json(entry.to_json(), "journal").rewritten == 7
    older = json.loads(entry.to_json())
    del older["rewritten"]
    assert ShardResult.from_json(json.dumps(older), "journal").rewritten == 0


def test_refused_without_the_extension_naming_why(source, tmp_path, monkeypatch):
    import packer.write.options as options

    monkeypatch.setattr(options, "region_decode_available", lambda: False)
    monkeypatch.setattr(options, "region_decode_missing_reason", lambda: "No module named '_jpegregion'")
    with pytest.raises(PackerError, match="needs the compiled JPEG region decoder.*_jpegregion"):
        convert(source, tmp_path / "x.lmdb", to="lmdb", jpeg_restarts=True, progress=False)
    assert not (tmp_path / "x.lmdb").exists()
