"""The payload ranges a conversion records for ranged reads by URL (packer/write/ranges.py, packer/layout/ranges.py):
each sample's file, offset and CRC-32, where the format stores payloads as plain byte ranges; in the manifest's
checked set; a damaged or crafted ranges file refused at open."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from support.fuzzing import _rewrite_checksums
from support.imagesets import make_imagefolder

from packer import open_dataset
from packer.errors import DatasetError
from packer.formats import FORMATS
from packer.layout.manifest import read_manifest
from packer.layout.ranges import RANGE_FILES, PayloadRanges
from packer.write.convert import convert

WITHOUT = {"bmp": "a file per sample, rows padded and bottom-up", "mosaic": "a sample is a tile of a larger image"}
OPTIONS: dict[str, dict] = {"mosaic": {"tile": "32x48"}}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    base = tmp_path_factory.mktemp("ranges")
    src = make_imagefolder(base / "imgs", classes=3, per_class=6)
    for name in FORMATS:
        convert(src, base / f"ds.{name}", to=name, shard_bytes=6_000, workers=0, progress=False,
                **OPTIONS.get(name, {}))
    convert(src, base / "raw.memmap", to="memmap", payload="raw", shard_bytes=20_000, workers=0, progress=False)
    return base


@pytest.mark.parametrize("name", [f"ds.{f}" for f in FORMATS] + ["raw.memmap"])
def test_each_recorded_range_holds_the_payload_the_format_reads_with_its_crc32(converted, name):
    root = converted / name
    manifest = read_manifest(root)
    with open_dataset(root) as ds:
        index = ds.store.index
        ranges = PayloadRanges.load(root, manifest, index)
        if name.split(".")[1] in WITHOUT:
            assert ranges is None and not any(f.name in RANGE_FILES.values() for f in manifest.meta_files)
            return
        assert ranges is not None and len(manifest.shards) > 1
        listed = {f.name: f.sha256 for f in manifest.meta_files}
        assert all(listed.get(n) for n in RANGE_FILES.values())  # checked like the rest of meta/
        for pos in range(len(ds)):
            shard, _ = ds.store.locate(pos)
            path = root / manifest.shards[shard].files[int(ranges.file[pos])].name
            with open(path, "rb") as fh:
                fh.seek(int(ranges.offset[pos]))
                stored = fh.read(int(index.nbytes[pos]))
            payload = ds.payload_at(pos)
            want = np.ascontiguousarray(payload).tobytes() if isinstance(payload, np.ndarray) else bytes(payload)
            assert stored == want and zlib.crc32(stored) == int(ranges.crc32[pos])


def test_a_modified_ranges_file_is_refused_and_a_crafted_one_too(converted, tmp_path):
    import shutil

    root = tmp_path / "ds.lmdb"
    shutil.copytree(converted / "ds.lmdb", root)
    offsets = root / RANGE_FILES["offset"]
    good = np.load(offsets)
    bad = good.copy()
    bad[3] += 1 << 30  # far past its file's end
    np.save(offsets, bad)
    with open_dataset(root) as ds, pytest.raises(DatasetError, match="payload_offset.npy: size or checksum differs"):
        PayloadRanges.load(root, read_manifest(root), ds.store.index)
    _rewrite_checksums(root)  # a crafter makes the manifest agree
    with open_dataset(root) as ds, pytest.raises(DatasetError, match="a payload past the end of its file"):
        PayloadRanges.load(root, read_manifest(root), ds.store.index)


def test_verify_deep_finds_a_payload_moved_away_from_its_recorded_range(converted, tmp_path):
    import shutil

    from support.fuzzing import put_sample_value

    from packer.tools.verify import verify

    root = tmp_path / "ds.lmdb"
    shutil.copytree(converted / "ds.lmdb", root)
    assert verify(root, deep=True).ok and verify(root, deep=True).checked["payload ranges"] == 18
    with open_dataset(root) as ds:
        data = bytes(ds.read_payload(4))
    put_sample_value(root, 4, data + b"\0")  # a valid JPEG, one byte longer: lmdb puts it elsewhere
    report = verify(root, deep=True)
    assert report.problems == [f"{root}: sample 4: its payload is not the one meta/ records for ranged reads (a URL "
                               "of this dataset would read other bytes)"]
