"""The format registry: format name -> module with ``Writer``, ``Reader`` and a few constants.

A format module defines:

- ``NAME``: the name used on the command line and stored in the manifest;
- ``PAYLOADS``: the payloads it can store (``encoded`` bytes and/or ``raw`` pixels);
- ``DEFAULT_SHARD_BYTES``: the shard size cap it prefers (``None``: one shard);
- ``COMPRESSIONS`` (optional): the ``--compression`` codecs it offers for raw payloads;
- ``Writer(directory, shard_id, num_samples, payload, options)`` with ``add(sample)`` and
  ``close() -> (file names, facts)``; it writes one shard;
- ``Reader(directory, shard, payload)`` that opens nothing until its first ``read(pos)``
  in the current process, with ``read_many(positions)`` for runs of neighbours and ``close()``;
  optionally ``fixed_shape`` ((H, W, 3) when every sample of the shard has it, else None) and
  ``read_into(ascending positions, out)`` that fills a preallocated batch array in one copy;
  and for read-ahead (packer.read.readahead) either ``file_spans(positions)`` (per position, the
  ``(path, start, end)`` byte ranges reading it touches, the sample's own bytes last) or, for
  one file per sample, ``prefetch(positions)`` (ask the kernel for the files, all at once).

Writers may receive fewer samples than ``num_samples`` (the rest failed validation).

Optional: ``check_options(options)`` (refuse bad format options before any work),
``error_bound(options) -> (mean, max)`` (absolute pixel error of a lossy format, (0, 0) = exact),
``block_boundaries(manifest)`` (natural block starts + N for the block sampler, e.g. one per mosaic;
the format's dataset class then has a ``block_boundaries()`` method),
``shard_multiple(options)`` (plan shards in whole units of this many samples, e.g. one mosaic).

Adding a format is one module here plus one line in ``FORMATS``.
"""

from __future__ import annotations

from types import ModuleType

from packer.errors import PackerError
from packer.formats import bmp as _bmp
from packer.formats import hdf5 as _hdf5
from packer.formats import lmdb as _lmdb
from packer.formats import memmap as _memmap
from packer.formats import mosaic as _mosaic

FORMATS: dict[str, ModuleType] = {m.NAME: m for m in (_lmdb, _hdf5, _memmap, _bmp, _mosaic)}


def get_format(name: str) -> ModuleType:
    try:
        return FORMATS[name]
    except KeyError:
        raise PackerError(f"unknown format {name!r} (choose from {', '.join(FORMATS)})") from None
