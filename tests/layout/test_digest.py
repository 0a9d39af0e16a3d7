"""Checksums taken while writing (``StreamDigest``) equal a read-back of the finished file."""

import hashlib
from pathlib import Path

import numpy as np
import pytest
from support.imagesets import make_imagefolder

from packer import convert, open_dataset
from packer.layout import digest
from packer.layout.digest import StreamDigest
from packer.layout.manifest import sha256_file
from packer.write import journal


def test_stream_digest_is_sha256_of_the_buffers_in_order(monkeypatch):
    monkeypatch.setattr(digest, "_BATCH_BYTES", 1000)  # many hand-overs to the thread
    rng = np.random.default_rng(0)
    parts = [rng.bytes(int(n)) for n in rng.integers(0, 3000, 200)]
    d = StreamDigest()
    for i, p in enumerate(parts):
        d.update(p if i % 2 else memoryview(np.frombuffer(p, np.uint8)))
    assert d.hexdigest() == hashlib.sha256(b"".join(parts)).hexdigest()


def test_cancelled_digest_ends_its_thread():
    d = StreamDigest()
    d.update(b"x" * (8 << 20))
    d.cancel()
    assert not d._thread.is_alive()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_imagefolder(tmp_path_factory.mktemp("digest") / "src", classes=2, per_class=12)


@pytest.mark.parametrize("options", [{"payload": "encoded"}, {"payload": "raw"},
                                     {"payload": "raw", "resize": "16x16"}])
def test_memmap_data_files_are_not_read_back_and_checksums_hold(source, tmp_path, monkeypatch, options):
    read_back: list[str] = []

    def spy(path: Path, *args) -> str:
        read_back.append(path.name)
        return sha256_file(path, *args)

    monkeypatch.setattr(journal, "sha256_file", spy)
    out = tmp_path / "o.memmap"
    convert(source, out, to="memmap", workers=0, progress=False, shard_bytes=4_000, **options)
    shards = open_dataset(out).manifest.shards
    files = [f for s in shards for f in s.files]
    assert len(shards) > 1
    for f in files:
        assert sha256_file(out / f.name) == f.sha256
        assert f.num_bytes == (out / f.name).stat().st_size
    data_files = {f.name for f in files if f.name.endswith((".bin", ".pixels.npy"))}
    assert data_files and not data_files & set(read_back)
