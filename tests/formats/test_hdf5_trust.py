"""Crafted HDF5 shards: nothing is read outside the file, nothing allocated beyond what the writer's layout allows.

Each test edits a real packed shard with h5py the way a crafter would (checksums recomputed, so
``packer verify``'s sha256 pass agrees) and checks that opening the dataset, ``packer verify``
(plain and ``--deep``) and ``packer extract`` all refuse it with a PackerError naming the shard
and the reason. The "outside" file holds the very same data, so reading through it would
return valid images: only refusing the link can pass.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.fuzzing import _rewrite_checksums
from support.memlimit import limited_call

from packer import PackerError, convert, open_dataset
from packer.tools.extract import extract
from packer.tools.verify import verify

SHARD = "shard-00000.h5"


@pytest.fixture(scope="module")
def bases(imagefolder, tmp_path_factory):
    root = tmp_path_factory.mktemp("h5trust")
    kinds = {"encoded": {}, "raw": {"payload": "raw", "resize": "20"},
             "gzip": {"payload": "raw", "resize": "20", "compression": "gzip"},
             "fixed": {"payload": "raw", "resize": "16x16", "compression": "gzip"}}
    for name, options in kinds.items():
        convert(imagefolder, root / name, to="hdf5", workers=1, progress=False, **options)
    return root


def crafted(bases: Path, tmp_path: Path, kind: str, edit) -> Path:
    """A copy of base ``kind`` with its shard edited by ``edit(f, outside)``, checksums recomputed.

    ``outside`` is a copy of the untouched shard beside the dataset (the file links would lead to).
    """
    ds = tmp_path / "ds"
    shutil.copytree(bases / kind, ds)
    outside = tmp_path / "outside.h5"
    shutil.copy(ds / SHARD, outside)
    with h5py.File(ds / SHARD, "r+") as f:
        edit(f, outside)
    _rewrite_checksums(ds)
    return ds


def assert_refused(ds: Path, tmp_path: Path, match: str) -> None:
    """open_dataset, verify, verify --deep and extract all refuse the dataset, naming the shard and the reason."""
    with pytest.raises(PackerError, match=match) as info:
        open_dataset(ds)
    assert SHARD in str(info.value)
    for deep in (False, True):
        report = verify(ds, deep=deep)
        assert not report.ok and any(SHARD in p and match in p for p in report.problems), report.problems
    with pytest.raises(PackerError, match=match):
        extract(ds, tmp_path / "extracted")


def _blob(f: h5py.File) -> np.ndarray:
    data = f["images"][()]
    del f["images"]
    return data


# ------------------------------------------------------------------ data outside the file (item: external)


def test_external_link_is_refused(bases, tmp_path):
    def edit(f, outside):
        del f["images"]
        f["images"] = h5py.ExternalLink(str(outside), "/images")
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, "ExternalLink")


def test_external_link_for_offsets_is_refused(bases, tmp_path):
    def edit(f, outside):
        del f["offsets"]
        f["offsets"] = h5py.ExternalLink(str(outside), "/offsets")
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, "ExternalLink")


def test_soft_link_is_refused(bases, tmp_path):
    def edit(f, outside):
        f.move("images", "elsewhere")
        f["images"] = h5py.SoftLink("/elsewhere")
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, "SoftLink")


def test_external_storage_is_refused(bases, tmp_path):
    def edit(f, outside):
        data = _blob(f)
        raw = outside.with_name("outside.bin")
        raw.write_bytes(data.tobytes())
        f.create_dataset("images", shape=data.shape, dtype="u1", external=[(str(raw), 0, data.size)])
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, "external files")


def test_external_storage_of_offsets_is_refused(bases, tmp_path):
    def edit(f, outside):
        offsets = f["offsets"][()]
        del f["offsets"]
        raw = outside.with_name("offsets.bin")
        raw.write_bytes(offsets.astype("<i8").tobytes())
        f.create_dataset("offsets", shape=offsets.shape, dtype="<i8", external=[(str(raw), 0, offsets.nbytes)])
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, "external files")


def test_virtual_dataset_is_refused(bases, tmp_path):
    def edit(f, outside):
        n = _blob(f).size
        layout = h5py.VirtualLayout(shape=(n,), dtype="u1")
        layout[:] = h5py.VirtualSource(str(outside), "images", shape=(n,))
        f.create_virtual_dataset("images", layout)
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, "virtual dataset")


# ------------------------------------------------------------------ layouts and filters the writer never makes


@pytest.mark.parametrize("options", [{"compression": "gzip", "chunks": (1 << 20,)},
                                     {"fletcher32": True, "chunks": (1 << 20,)}, {"chunks": (4096,)}, {}],
                         ids=["gzip", "fletcher32", "chunks", "contiguous"])
def test_filters_and_layouts_the_writer_never_makes_are_refused(bases, tmp_path, options):
    def edit(f, outside):
        data = _blob(f)
        f.create_dataset("images", data=data, maxshape=(None,) if options else None, **options)
    match = "storage layout" if not options else "chunks"
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, match)


def test_images_that_is_a_group_is_refused(bases, tmp_path):
    def edit(f, outside):
        _blob(f)
        f.create_group("images")
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, "is a Group")


def test_offsets_of_another_type_are_refused(bases, tmp_path):
    def edit(f, outside):
        offsets = f["offsets"][()]
        del f["offsets"]
        f.create_dataset("offsets", data=offsets.astype("<f8"))
    assert_refused(crafted(bases, tmp_path, "encoded", edit), tmp_path, "int64")


# ------------------------------------------------------------------ allocation bombs


BOMB_CHUNK = 256 << 20  # one chunk inflating to 256 MiB (the writer's compressed chunks are 256 KiB)


def _gzip_chunk(data: bytes, size: int) -> bytes:
    """A deflate stream of ``data`` padded with zeros to ``size`` bytes (a few hundred KB)."""
    z = zlib.compressobj(1)
    parts = [z.compress(data)]
    zeros = bytes(16 << 20)
    left = size - len(data)
    while left > 0:
        parts.append(z.compress(zeros[: min(left, len(zeros))]))
        left -= len(zeros)
    return b"".join(parts) + z.flush()


def _read_all(path: Path) -> int:
    ds = open_dataset(path, image="numpy")
    return sum(ds[i][0].size for i in range(len(ds)))


def test_gzip_chunk_bomb_is_refused_before_inflating(bases, tmp_path):
    def edit(f, outside):
        data = _blob(f)
        images = f.create_dataset("images", shape=data.shape, maxshape=(None,), dtype="u1", chunks=(BOMB_CHUNK,),
                                  compression="gzip")
        images.id.write_direct_chunk((0,), _gzip_chunk(data.tobytes(), BOMB_CHUNK))
    ds = crafted(bases, tmp_path, "gzip", edit)
    assert (ds / SHARD).stat().st_size < 2 << 20  # tiny on disk
    kind, message = limited_call(_read_all, ds, limit=1 << 30)
    assert kind == "DatasetError" and "chunks (268435456,)" in message, (kind, message)
    assert_refused(ds, tmp_path, "chunks")


def test_fixed_shape_beyond_the_pixel_limit_is_refused(bases, tmp_path):
    """Facts, /images and the index agree on 20000x20000 images: chunks never written would read as 1.2 GB of zeros."""
    side = 20000

    def edit(f, outside):
        n = f["images"].shape[0]
        del f["images"]
        f.create_dataset("images", shape=(n, side, side, 3), dtype="u1", chunks=(1, side, side, 3),
                         compression="gzip")
    ds = crafted(bases, tmp_path, "fixed", edit)
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["shards"][0]["facts"]["shape"] = [side, side, 3]
    (ds / "manifest.json").write_text(json.dumps(manifest))
    for name, value in (("heights", side), ("widths", side), ("nbytes", side * side * 3)):
        arr = np.load(ds / f"meta/{name}.npy")
        arr[:] = value
        np.save(ds / f"meta/{name}.npy", arr)
    _rewrite_checksums(ds)
    kind, message = limited_call(_read_all, ds, limit=1 << 30)
    assert kind in ("PackerError", "DecodeError") and "pixel limit" in message, (kind, message)



# ------------------------------------------------------------------ chunks the mapped reader cannot view


def test_images_chunk_never_written_is_refused_on_read(bases, tmp_path):
    """Uncompressed chunks are read as views of the mapped file at the offsets HDF5's chunk index gives; a chunk
    never written has none (h5py would read it as zeros): the read names the shard and the chunk."""
    def edit(f, outside):
        data = _blob(f)  # the deleted dataset's bytes stay in the file, so its size still admits the new one
        f.create_dataset("images", shape=data.shape, maxshape=(None,), dtype="u1", chunks=(1 << 20,))
    ds = crafted(bases, tmp_path, "encoded", edit)
    opened = open_dataset(ds)  # the structure is as the writer makes it
    with pytest.raises(PackerError, match="chunk 0 is 0 bytes") as info:
        opened.read_payload(0)
    assert SHARD in str(info.value)
    report = verify(ds, deep=True)
    assert not report.ok and any(SHARD in p and "chunk 0" in p for p in report.problems), report.problems
