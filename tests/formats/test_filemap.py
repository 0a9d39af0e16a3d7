"""packer.formats.filemap: a read-only map that holds no descriptor and goes with its last view."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from support.fds import open_files_under

from packer import PackerError
from packer.formats.filemap import map_array


def _mapped(path) -> bool:
    with open("/proc/self/maps") as fh:
        return any(line.rstrip().endswith(str(path)) for line in fh)


def test_a_map_is_the_file_read_only_without_a_descriptor(tmp_path):
    path = tmp_path / "block"
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 5, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    arr = map_array(path, fd, "sequential")
    assert open_files_under(path) == [str(path)]  # only ours: the map took no descriptor of its own
    os.close(fd)
    assert open_files_under(path) == []
    assert np.array_equal(arr, data) and not arr.flags.writeable
    view = arr[100:200]
    with pytest.raises(ValueError):
        view.setflags(write=True)  # a write would fault on the read-only map
    del arr
    gc.collect()
    assert _mapped(path) and bytes(view.data) == data[100:200].tobytes()  # the view keeps the map
    del view
    gc.collect()
    assert not _mapped(path)  # gone with its last view


def test_an_empty_file_is_a_packer_error(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(PackerError, match="empty"):
            map_array(path, fd, "random")
    finally:
        os.close(fd)
