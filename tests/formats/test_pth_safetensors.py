"""pth and safetensors: what is specific to them (round trip, fuzzing, verify: test_contract.py, test_fuzz.py).

Shards open with ``torch.load(path, weights_only=True)`` and with the ``safetensors`` package (a
test-only dependency) and hold what packer reads; a shard whose pickle would run code is refused
and the code never runs; opening a shard maps it instead of reading it; crafted archives and
headers give PackerError.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from support.fuzzing import _rewrite_checksums as recompute_checksums

from packer import PackerError, convert, open_dataset

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {"encoded": {}, "raw": {"payload": "raw"}, "raw-24x32": {"payload": "raw", "resize": "24x32"}}


@pytest.fixture(scope="module")
def packed(imagefolder, tmp_path_factory):
    root = tmp_path_factory.mktemp("tensors")
    out = {}
    for fmt in ("pth", "safetensors"):
        for name, opts in VARIANTS.items():
            out[fmt, name] = root / f"{name}.{fmt}"
            convert(imagefolder, out[fmt, name], to=fmt, shard_bytes=6_000, workers=1, progress=False,
                    order="source", **opts)  # stored in ImageFolder's order: the libraries' tensors line up with ds[i]
    return out


def expected_keys(variant: str) -> set[str]:
    return {"encoded": {"images", "offsets", "labels"}, "raw": {"images", "offsets", "shapes", "labels"},
            "raw-24x32": {"images", "labels"}}[variant]


def check_shard(arrays: dict, ds, start: int, n: int, variant: str) -> None:
    """The arrays of one shard, as another library loaded them, hold what packer reads."""
    assert set(arrays) == expected_keys(variant)
    assert arrays["labels"].tolist() == ds.targets[start : start + n]
    images = np.asarray(arrays["images"])
    for i in range(n):
        want = ds.read_payload(start + i)
        if variant == "raw-24x32":
            assert images.shape == (n, 24, 32, 3) and np.array_equal(images[i], want)
            continue
        a, b = (int(v) for v in arrays["offsets"][i : i + 2])
        got = images[a:b]
        if variant == "raw":
            got = got.reshape(tuple(int(v) for v in arrays["shapes"][i]))
        assert np.array_equal(got, want if variant == "raw" else np.frombuffer(want, np.uint8))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch_load_weights_only_opens_every_shard(packed, variant):
    path = packed["pth", variant]
    ds = open_dataset(path, image="numpy")
    start = 0
    for shard in ds.manifest.shards:
        tensors = torch.load(path / shard.files[0].name, weights_only=True)
        assert all(t.dtype in (torch.uint8, torch.int64) for t in tensors.values())
        check_shard({k: v.numpy() for k, v in tensors.items()}, ds, start, shard.num_samples, variant)
        start += shard.num_samples
    assert start == len(ds) and len(ds.manifest.shards) > 1


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_safetensors_package_reads_every_shard(packed, variant):
    st_numpy = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open

    path = packed["safetensors", variant]
    ds = open_dataset(path, image="numpy")
    start = 0
    for shard in ds.manifest.shards:
        file = path / shard.files[0].name
        check_shard(st_numpy.load_file(file), ds, start, shard.num_samples, variant)
        with safe_open(file, framework="pt") as fh:
            assert fh.metadata() == {"format": "packer", "payload": ds.manifest.payload,
                                     "layout": "fixed" if variant == "raw-24x32" else "blob"}
            check_shard({k: fh.get_tensor(k).numpy() for k in fh.keys()}, ds, start, shard.num_samples, variant)
        start += shard.num_samples
    assert start == len(ds)


def test_safetensors_layout_is_the_documented_one(packed):
    file = packed["safetensors", "raw"] / "shard-00000.safetensors"
    data = file.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + length])
    assert (8 + length) % 8 == 0 and data[8 + length - 1 : 8 + length] in (b" ", b"}")
    order = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    assert [k for _, k in order] == ["labels", "offsets", "shapes", "images"]


@pytest.mark.parametrize("fmt", ["pth", "safetensors"])
def test_samples_are_read_only_views_and_spans_hold_them(packed, fmt):
    for variant in VARIANTS:
        ds = open_dataset(packed[fmt, variant], image="numpy")
        for i in range(len(ds)):
            payload = ds.read_payload(i)
            assert payload.readonly if isinstance(payload, memoryview) else not payload.flags.writeable
            shard, pos = ds.locate(i)
            [[(file, a, b)]] = ds.store.readers[shard].file_spans([pos])
            with open(file, "rb") as fh:
                fh.seek(a)
                assert fh.read(b - a) == bytes(payload if isinstance(payload, memoryview) else payload.tobytes())


# ------------------------------------------------------------------ pickles that would run code


class Trap:
    """Unpickling this runs a command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def pth_copy(packed, tmp_path):
    shutil.copytree(packed["pth", "encoded"], tmp_path / "ds")
    return tmp_path / "ds"


def read_all(path: Path) -> None:
    ds = open_dataset(path)
    for i in range(len(ds)):
        ds[i]


@pytest.mark.parametrize("how", ["zip", "legacy", "plain-pickle"])
def test_a_shard_whose_pickle_would_run_code_is_refused_and_it_never_runs(pth_copy, tmp_path, how):
    marker = tmp_path / "marker"
    shard = pth_copy / "shard-00000.pth"
    real = torch.load(shard, weights_only=True)
    evil = {**real, "labels": Trap(marker)}
    if how == "zip":
        torch.save(evil, shard)  # the same archive layout, the name of the shard
    elif how == "legacy":
        torch.save(evil, shard, _use_new_zipfile_serialization=False)
    else:
        shard.write_bytes(pickle.dumps(evil))
    recompute_checksums(pth_copy)
    with pytest.raises(PackerError, match="refused or damaged|not a torch.save archive"):
        read_all(pth_copy)
    assert not marker.exists()
    if how == "zip":  # the trap is real: a load without weights_only runs it
        torch.load(shard, weights_only=False)
        assert marker.exists()


def test_every_torch_load_in_packer_is_weights_only():
    calls = [(p, m.group(0)) for p in (REPO / "packer").rglob("*.py")
             for m in re.finditer(r"torch\.load\([^)]*\)", p.read_text())]
    assert calls and all("weights_only=True" in call for _, call in calls), calls


def test_a_compressed_archive_record_is_refused(pth_copy):
    shard = pth_copy / "shard-00000.pth"
    with zipfile.ZipFile(shard) as src:
        records = [(info, src.read(info)) for info in src.infolist()]
    with zipfile.ZipFile(shard, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for info, data in records:
            dst.writestr(info.filename, data)
    recompute_checksums(pth_copy)
    with pytest.raises(PackerError, match="compressed"):
        read_all(pth_copy)


def test_tensors_other_than_promised_are_refused(pth_copy):
    shard = pth_copy / "shard-00000.pth"
    real = torch.load(shard, weights_only=True)
    for bad in ({**real, "labels": real["labels"].float()}, {**real, "extra": real["labels"]},
                {**real, "images": real["images"][::2]}, [real["images"]]):
        torch.save(bad, shard)
        recompute_checksums(pth_copy)
        with pytest.raises(PackerError, match="holds arrays|expected|not a dict"):
            read_all(pth_copy)


def test_opening_a_shard_maps_it_instead_of_reading_it(tmp_path):
    """A 60 MB raw shard opens and yields a sample with far less resident memory than its size."""
    from PIL import Image

    src = tmp_path / "big"
    (src / "a").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(20):
        Image.fromarray(rng.integers(0, 255, (1000, 1000, 3), dtype=np.uint8)).save(src / "a" / f"{i}.png",
                                                                                     compress_level=0)
    out = tmp_path / "big.pth"
    convert(src, out, to="pth", payload="raw", workers=1, progress=False)
    assert (out / "shard-00000.pth").stat().st_size > 59e6
    code = (
        "import sys, torch\nfrom packer import open_dataset\n"
        "def rss():\n"
        "    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1]) * 1024\n"
        "before = rss()\nds = open_dataset(sys.argv[1], image='numpy')\nds.read_payload(7)\nprint(rss() - before)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    assert int(res.stdout.split()[-1]) < 20e6  # one 3 MB sample touched, not the 60 MB shard


# ------------------------------------------------------------------ crafted safetensors headers


@pytest.fixture
def st_copy(packed, tmp_path):
    shutil.copytree(packed["safetensors", "raw"], tmp_path / "ds")
    return tmp_path / "ds"


def rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (length,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])


@pytest.mark.parametrize("edit,match", [
    (lambda h: h["images"].update(dtype="F32"), "not a U8/I64"),
    (lambda h: h["images"].update(shape=[10**12]), "covers"),
    (lambda h: h["labels"].update(data_offsets=[8, h["labels"]["data_offsets"][1] + 8]),
     "overlap or leave gaps|covers"),
    (lambda h: h.pop("labels"), "overlap or leave gaps"),
    (lambda h: h.update(extra={"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}), "holds arrays"),
    (lambda h: h.update(__metadata__={"a": 1}), "metadata"),
    (lambda h: h["images"].update(data_offsets="x"), "not a U8/I64"),
], ids=["dtype", "shape", "offsets", "gap", "extra", "metadata", "garbage"])
def test_crafted_safetensors_headers_are_refused(st_copy, edit, match):
    rewrite_header(st_copy / "shard-00000.safetensors", edit)
    recompute_checksums(st_copy)
    with pytest.raises(PackerError, match=match):
        read_all(st_copy)


@pytest.mark.parametrize("prefix", [struct.pack("<Q", 2**63), struct.pack("<Q", 0), b"\x01\x02"])
def test_a_header_length_past_the_file_is_refused(st_copy, prefix):
    shard = st_copy / "shard-00000.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(prefix + data[8:] if len(prefix) == 8 else prefix)
    recompute_checksums(st_copy)
    with pytest.raises(PackerError, match="safetensors header of|not a safetensors file"):
        read_all(st_copy)
