"""Datasets in other tools' layouts, written in the test by those tools (or by the format's own rules).

WebDataset shards come from ``webdataset.TarWriter``, Hugging Face datasets from ``datasets``
(``save_to_disk`` and ``to_parquet``); both are test-only dependencies: packer reads them with
tarfile and pyarrow. RecordIO files come from ``write_mxnet_rec``, a writer following MXNet's
``MXIndexedRecordIO`` layout written here from the format's description (not packer's writer).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from support.imagesets import jpeg_bytes


@dataclass
class Item:
    """One sample as the source states it."""

    key: str
    image: bytes
    label: int


def items(count: int, classes: int = 3, seed: int = 0) -> list[Item]:
    rng = np.random.default_rng(seed)
    return [Item(f"s{i:04d}", jpeg_bytes(rng, 20 + i % 5, 24 + i % 3), i % classes) for i in range(count)]


def make_wds(folder: Path, samples: list[Item], per_shard: int = 4, label: str = "cls",
             extra: bool = True) -> list[Path]:
    """``shards-000000.tar``... written by webdataset's TarWriter: jpg, the label (``cls`` or json ``label``), txt."""
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(0, len(samples), per_shard):
        path = folder / f"shards-{k // per_shard:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for it in samples[k : k + per_shard]:
                sample = {"__key__": it.key, "jpg": it.image}
                if label == "cls":
                    sample["cls"] = it.label
                else:
                    sample["json"] = {"label": it.label, "note": "x"}
                if extra:
                    sample["txt"] = f"caption {it.key}"
                sink.write(sample)
        paths.append(path)
    return paths


def make_hf(folder: Path, samples: list[Item], names: list[str], rows_per_group: int = 4) -> tuple[Path, Path]:
    """A ``save_to_disk`` folder and a Parquet file of the same rows (an Image and a ClassLabel column)."""
    import datasets

    ds = datasets.Dataset.from_dict({"image": [{"bytes": it.image, "path": f"{it.key}.jpg"} for it in samples],
                                     "label": [it.label for it in samples]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.ClassLabel(names=names)}))
    disk, parquet = folder / "saved", folder / "data.parquet"
    ds.save_to_disk(str(disk))
    ds.to_parquet(str(parquet), batch_size=rows_per_group)
    return disk, parquet


MAGIC = 0xCED7230A


def mxnet_record(image: bytes, label: float | list[float], id_: int) -> bytes:
    """One record as ``recordio.pack`` + ``MXRecordIO.write`` make it (no magic inside ``image``: one part)."""
    if isinstance(label, list):
        header = struct.pack("<IfQQ", len(label), 0.0, id_, 0) + struct.pack(f"<{len(label)}f", *label)
    else:
        header = struct.pack("<IfQQ", 0, label, id_, 0)
    data = header + image
    words = np.frombuffer(data[: len(data) // 4 * 4], "<u4")
    assert not np.any(words == MAGIC), "this simple writer writes one-part records only"
    return struct.pack("<II", MAGIC, len(data)) + data + b"\0" * (-len(data) % 4)


def write_mxnet_rec(rec: Path, records: list[tuple[bytes, float | list[float], int]], keys: list[str] | None = None,
                    index: bool = True) -> list[int]:
    """``rec`` (and ``rec.idx`` beside it, ``key\\toffset`` lines) as MXIndexedRecordIO writes; returns offsets."""
    offsets, blob = [], bytearray()
    for image, label, id_ in records:
        offsets.append(len(blob))
        blob += mxnet_record(image, label, id_)
    rec.write_bytes(bytes(blob))
    if index:
        keys = keys or [str(i) for i in range(len(records))]
        rec.with_suffix(".idx").write_text("".join(f"{k}\t{o}\n" for k, o in zip(keys, offsets)))
    return offsets


def json_bytes(value: object) -> bytes:
    return json.dumps(value).encode()
