"""LMDB: one memory-mapped B-tree file per shard, keys in order, values = payloads.

| file                 | holds                                                              |
|----------------------|--------------------------------------------------------------------|
| shard-00000.lmdb     | LMDB environment (``subdir=False``, no lock file); key ``%010d`` of |
|                      | the sample's position in the shard (ASCII), value the payload:      |
|                      | encoded file bytes, or raw HWC uint8 RGB bytes (shape in ``meta/``) |
| shard-00000.spans.npy| [N, 3] int64: each sample's leaf page offset and value start/end in |
|                      | the file: readers slice values from their own map of the file with   |
|                      | them (``values``), read-ahead plans with them (packer.read.readahead)|

Raw payloads resized to one shape (``--resize HxW``) are recorded as such in the manifest (shard facts ``layout:
fixed``, ``shape``): ``get_batch`` then copies whole batches (``read_into``). ``writer`` writes with py-lmdb,
``reader`` reads without it, ``pages`` parses LMDB's own pages, ``values`` hands out the values.
"""

from __future__ import annotations

from packer.formats.base import Format
from packer.formats.lmdb.reader import Reader
from packer.formats.lmdb.writer import Writer

__all__ = ["FORMAT", "Reader", "Writer"]

FORMAT = Format(
    name="lmdb", dataset_class="LMDBDataset", payloads=frozenset({"encoded", "raw", "none"}),
    Writer=Writer, Reader=Reader,
    default_shard_bytes=1 << 30,
)
