"""HDF5: one ordinary ``.h5`` file per shard that ``h5ls``/``h5py`` users can read without packer.

| dataset (per shard file) | dtype | shape     | holds                                                    |
|--------------------------|-------|-----------|----------------------------------------------------------|
| /images  (encoded)       | u1    | [B]       | the source files' bytes back to back                      |
| /images  (raw, one shape)| u1    | [N,H,W,3] | RGB pixels (``--resize HxW``), one image per chunk        |
| /images  (raw, mixed)    | u1    | [B]       | HWC RGB pixels back to back                               |
| /offsets (blob layouts)  | <i8   | [N+1]     | sample i is ``images[offsets[i]:offsets[i+1]]``           |
| /shapes  (raw, mixed)    | <i8   | [N,3]     | (h, w, 3) of each sample                                  |
| /labels                  | <i8   | [N]       | class index (-1 for a flat folder); names in manifest.json|

Every dataset has a ``description`` attribute, the file has ``packer_format``, ``payload``, ``layout`` (``fixed`` or
``blob``), ``num_samples`` and ``description``. ``writer`` and ``reader`` are the two directions, ``chunks`` the
zero-copy reads of uncompressed chunks, ``checks`` what a dataset must be before it is read. One shard by default:
samples are found by offset or row, so one file costs nothing in lookups and is the file a user expects.
"""

from __future__ import annotations

from pathlib import Path

from packer.formats.base import Format, ShardReader, ShardWriter
from packer.layout.manifest import Shard

__all__ = ["FORMAT", "Reader", "Writer"]


def Reader(directory: Path, shard: Shard, payload: str, access: str = "sequential") -> ShardReader:  # noqa: N802
    """hdf5's shard reader (``reader.Reader``), h5py imported on first use: packer.formats is imported by every
    reader of any format (a spawned DataLoader worker of an lmdb dataset too), and importing h5py is slow."""
    from packer.formats.hdf5.reader import Reader as ShardFileReader

    return ShardFileReader(directory, shard, payload, access=access)


def Writer(directory: Path, shard_id: int, num_samples: int, payload: str, options: dict) -> ShardWriter:  # noqa: N802
    """hdf5's shard writer (``writer.Writer``), h5py imported on first use (as ``Reader``)."""
    from packer.formats.hdf5.writer import Writer as ShardFileWriter

    return ShardFileWriter(directory, shard_id, num_samples, payload, options)


FORMAT = Format(
    name="hdf5", dataset_class="HDF5Dataset", payloads=frozenset({"encoded", "raw", "none"}),
    Writer=Writer, Reader=Reader, default_shard_bytes=None, compressions=frozenset({"lzf", "gzip"}),
)
