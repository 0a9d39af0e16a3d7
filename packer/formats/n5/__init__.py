"""N5: one chunked N5 container per shard (the Java/Saalfeld layout), readable by tensorstore's ``n5``
driver, zarr's N5 store, the Java N5 libraries and Fiji/BigDataViewer without packer.

| path (per shard, in shard-00000.n5/) | N5 dimensions  | dtype | holds                                       |
|--------------------------------------|----------------|-------|---------------------------------------------|
| attributes.json                      |                |       | ``{"n5": "2.0.0", "packer": {...}}``         |
| images/ (raw, ``--resize HxW``)      | [3, W, H, N]   | uint8 | RGB pixels: numpy ``(N, H, W, 3)``           |
| images/ (encoded; raw, mixed shapes) | [B]            | uint8 | the files' bytes (or HWC pixels) back to back|
| offsets/ (blob layouts)              | [N+1]          | int64 | sample i is ``images[offsets[i]:offsets[i+1]]`` |
| shapes/ (raw, mixed shapes)          | [3, N]         | int64 | numpy ``(N, 3)``: (h, w, 3) of each sample   |
| labels/                              | [N]            | int64 | class index (-1 for a flat folder)           |

Each dataset directory holds ``attributes.json`` and one file per block at ``<dataset>/<i0>/<i1>/...``; N5 lists
dimensions fastest-varying first, the reverse of numpy's order (same bytes). Images are blocked along N only
(``blocks.BLOCK_BYTES`` per block file, ``--n5-block`` another size). ``blocks`` holds the on-disk pieces, ``writer``
and ``reader`` the two directions; one shard by default (a directory of block files, never one huge file).
"""

from __future__ import annotations

from collections.abc import Mapping

from packer.argtypes import size_arg
from packer.formats.base import Format, Option
from packer.formats.n5.reader import Reader
from packer.formats.n5.writer import Writer, block_bytes

__all__ = ["FORMAT", "Reader", "Writer"]


class N5Format(Format):
    def check_options(self, options: Mapping) -> None:
        block_bytes(options)


FORMAT = N5Format(
    name="n5", dataset_class="N5Dataset", payloads=frozenset({"encoded", "raw", "none"}),
    Writer=Writer, Reader=Reader,
    default_shard_bytes=None,
    compressions=frozenset({"gzip"}),
    options=(Option("n5_block", "n5: bytes of images per block file (default 960KiB); "
                    "whole images with --resize HxW", metavar="SIZE", type=size_arg),),
)
