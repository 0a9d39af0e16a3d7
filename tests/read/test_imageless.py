"""Samples without an image (tokens, embeddings, boxes): ``Writer.add`` with no ``image``, every format that can hold
them (payload ``none``), ``ds[i]`` as ``(fields, label)``, ``fields=`` as for images, DataLoader workers, a re-pack,
and clear refusals where an image is needed (bmp, mosaic, recordio, crops, decoding, extract, WebDataset)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.cli import run_cli
from support.imagesets import jpeg_bytes
from torch.utils.data import DataLoader

from packer import PackerError, RandomResizedCropDecode, Writer, collate, convert, export_wds, open_dataset
from packer.formats import FORMATS
from packer.tools.extract import extract
from packer.tools.verify import verify

HOLDING = ("lmdb", "hdf5", "memmap", "n5", "pth", "safetensors")
FIELDS = {"tokens": "int32[:]", "embedding": "float32[4]", "caption": "str"}


def samples(n: int = 9) -> list[dict]:
    rng = np.random.default_rng(2)
    return [{"label": k % 3, "tokens": rng.integers(0, 1000, k % 4 + 1).astype(np.int32),
             "embedding": rng.random(4).astype(np.float32), "caption": f"sample {k}"} for k in range(n)]


def write(path: Path, fmt: str, items: list[dict], **kw) -> Path:
    with Writer(path, format=fmt, fields=FIELDS, shard_bytes=120, **kw) as w:  # small shards: several
        for s in items:
            w.add(**s)
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("imageless")
    return {fmt: write(root / fmt, fmt, samples()) for fmt in HOLDING}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) if isinstance(a[k], np.ndarray) else a[k] == b[k]
                                        for k in a)


@pytest.mark.parametrize("fmt", HOLDING)
def test_every_format_that_can_holds_samples_without_an_image(written, fmt):
    want = samples()
    ds = open_dataset(written[fmt])
    assert ds.manifest.payload == "none" and not ds.has_images and len(ds.manifest.shards) > 1
    for i, s in enumerate(want):
        fields, label = ds[i]
        assert label == s["label"] and same(fields, {k: v for k, v in s.items() if k != "label"})
    tokens, label = open_dataset(written[fmt], fields=("tokens", "label"))[3]
    assert np.array_equal(tokens, want[3]["tokens"]) and label == want[3]["label"]
    every = open_dataset(written[fmt], fields="all")[5]
    assert same(every, want[5])
    assert verify(written[fmt], deep=True).ok


def test_default_collate_and_packer_collate_in_two_workers(written):
    ds = open_dataset(written["lmdb"], fields=("embedding", "label"))
    embeddings, labels = next(iter(DataLoader(ds, batch_size=9, num_workers=2)))  # one size: stacked
    assert embeddings.shape == (9, 4) and labels.tolist() == [s["label"] for s in samples()]
    ragged = open_dataset(written["lmdb"], fields=("tokens", "label"))
    with pytest.raises(PackerError, match="collate_fn=packer.collate"):
        next(iter(DataLoader(ragged, batch_size=9, num_workers=2)))
    tokens, _ = next(iter(DataLoader(ragged, batch_size=9, num_workers=2, collate_fn=collate)))
    assert [len(t) for t in tokens] == [len(s["tokens"]) for s in samples()]
    plain = open_dataset(written["hdf5"], transform=lambda f: torch.from_numpy(f["embedding"]),
                         target_transform=lambda t: t + 10)
    x, y = next(iter(DataLoader(plain, batch_size=9, num_workers=0)))  # transform is given the fields dict
    assert x.shape == (9, 4) and y.tolist() == [s["label"] + 10 for s in samples()]
    cached = open_dataset(written["memmap"], cache="ram", cache_options={"progress": False})
    assert same(cached[2][0], open_dataset(written["memmap"])[2][0])


def test_a_repack_keeps_them_and_an_image_is_never_invented(written, tmp_path):
    again = convert(written["lmdb"], tmp_path / "again.hdf5", to="hdf5", workers=0, progress=False).output
    ds, src = open_dataset(again), open_dataset(written["lmdb"])
    assert ds.manifest.payload == "none" and all(same(ds[i][0], src[i][0]) for i in range(len(ds)))
    for payload in ("raw", "encoded"):
        with pytest.raises(PackerError, match="have no image, so --payload .* has nothing to store"):
            convert(written["lmdb"], tmp_path / f"x-{payload}", to="lmdb", payload=payload, workers=0,
                    progress=False)
    folder = tmp_path / "imgs" / "a"
    folder.mkdir(parents=True)
    (folder / "x.jpg").write_bytes(jpeg_bytes(np.random.default_rng(0), 8, 8))
    with pytest.raises(PackerError, match="holds images; --payload none would leave them out"):
        convert(tmp_path / "imgs", tmp_path / "y.lmdb", payload="none", workers=0, progress=False)
    with pytest.raises(PackerError, match="no image, and a WebDataset sample is exported with one"):
        export_wds(written["lmdb"], tmp_path / "w", workers=0, progress=False)


@pytest.mark.parametrize("fmt", sorted(set(FORMATS) - set(HOLDING)))
def test_formats_of_images_only_refuse_them_by_name(tmp_path, fmt):
    with pytest.raises(PackerError, match=f"format '{fmt}' stores images only: .* go to lmdb, hdf5, memmap"):
        write(tmp_path / "x", fmt, samples(2), **({"tile": "8x8"} if fmt == "mosaic" else {}))


def test_what_needs_an_image_says_so(written, tmp_path):
    rng = np.random.default_rng(1)
    with pytest.raises(PackerError, match="sample 1: an image, but this dataset holds none"):
        with Writer(tmp_path / "mixed.lmdb") as w:
            w.add(label=0)
            w.add(jpeg_bytes(rng, 8, 8), label=0)
    with pytest.raises(PackerError, match="sample 1: no image, but this dataset stores images"):
        with Writer(tmp_path / "mixed2.lmdb") as w:
            w.add(jpeg_bytes(rng, 8, 8), label=0)
            w.add(label=0)
    path = written["lmdb"]
    with pytest.raises(PackerError, match="no field 'image' \\(its samples have no image\\)"):
        open_dataset(path, fields=("image", "label"))
    with pytest.raises(PackerError, match="crop= has nothing to apply to"):
        open_dataset(path, crop=RandomResizedCropDecode(8))
    ds = open_dataset(path)
    for call in (lambda: ds.get_batch([0, 1]), lambda: ds.pixels(0),
                 lambda: open_dataset(path, cache="ram-decoded", cache_options={"progress": False})):
        with pytest.raises(PackerError, match="no image"):
            call()
    with pytest.raises(PackerError, match="no image, so there is no ImageFolder to extract"):
        extract(path, tmp_path / "out")
    info = run_cli("info", path)
    assert info.returncode == 0 and "payload     none (no images: fields and labels only)" in info.stdout
    assert "image size" not in info.stdout and "per sample" not in info.stdout
