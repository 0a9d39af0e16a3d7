"""An HDF5 shard's datasets checked to be stored as packer's writer stores them, before anything is read from them:
hard links inside the file (no external or soft links), no virtual datasets, no external storage, the writer's
storage layout. ``reader.Reader`` checks each dataset it reads this way (and then their shapes, chunks and filters).
"""

from __future__ import annotations

from pathlib import Path

import h5py

from packer.errors import PackerError


def stored_dataset(f: h5py.File, name: str, layout: int, path: Path) -> h5py.Dataset:
    """``/name``, refused unless it is a dataset stored inside this file with the writer's ``layout``."""
    link = f.get(name, getlink=True)
    if link is None:
        raise PackerError(f"{path}: missing HDF5 dataset /{name}")
    if not isinstance(link, h5py.HardLink):  # resolving an external link would open another file
        target = f" to {link.filename}:{link.path}" if isinstance(link, h5py.ExternalLink) else ""
        raise PackerError(f"{path}: /{name} is a {type(link).__name__}{target}, not a dataset of this "
                          "file; packer reads nothing outside the dataset")
    dset = f.get(name)
    if not isinstance(dset, h5py.Dataset):
        raise PackerError(f"{path}: /{name} is a {type(dset).__name__}, expected a dataset")
    plist = dset.id.get_create_plist()
    found = plist.get_layout()
    if found == h5py.h5d.VIRTUAL:
        raise PackerError(f"{path}: /{name} is a virtual dataset (its data lie in other files); refusing it")
    if plist.get_external_count():
        raise PackerError(f"{path}: /{name} keeps its data in external files; refusing it")
    if found != layout:
        names = {h5py.h5d.COMPACT: "compact", h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.CHUNKED: "chunked"}
        raise PackerError(f"{path}: /{name} has storage layout {names.get(found, found)}, the writer "
                          f"makes {names[layout]}")
    return dset
