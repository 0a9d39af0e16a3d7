"""Read-side checks for datasets that may be damaged or crafted: one place for every format.

A packed dataset is untrusted input (copied between machines, shared, downloaded). These
helpers turn what a hostile or damaged file could do (paths leaving the dataset directory,
symlinks out of it, ``.npy`` headers promising more bytes than the file holds, offsets past
the end, exceptions from C libraries) into a ``PackerError`` naming the file and the reason.
Nothing here unpickles: ``.npy`` files are loaded with ``allow_pickle=False`` after their
header has been checked against the file's size, so no allocation exceeds what the file holds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import struct
import tokenize
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from packer.errors import DatasetError, PackerError

try:  # optional at import time: only for the exception mapping below
    import lmdb as _lmdb

    _LMDB_ERRORS: tuple[type[BaseException], ...] = (_lmdb.Error,)
except ImportError:  # pragma: no cover
    _LMDB_ERRORS = ()

# Exceptions that damaged or crafted bytes can raise inside readers and codecs (h5py raises
# OSError/KeyError/ValueError/RuntimeError; numpy ValueError/TypeError; Pillow also EOFError,
# struct.error, IndexError, SyntaxError). `reading()` maps them to PackerError at the boundary
# of PackedDataset, with the original chained (``raise ... from``) so a real bug stays visible.
DATA_ERRORS: tuple[type[BaseException], ...] = (
    OSError, ValueError, KeyError, IndexError, TypeError, RuntimeError, EOFError, SyntaxError,
    ZeroDivisionError, OverflowError, UnicodeDecodeError, struct.error, zlib.error, *_LMDB_ERRORS,
)


@contextlib.contextmanager
def reading(where: str) -> Iterator[None]:
    """Turn a data-caused exception raised while reading ``where`` into a PackerError naming it."""
    try:
        yield
    except PackerError:
        raise
    except DATA_ERRORS as exc:
        raise DatasetError(f"{where}: damaged or not a valid packed dataset ({type(exc).__name__}: {exc})") from exc


def check_inner_name(name: object, where: str) -> str:
    """A relative name that stays inside the dataset directory (no absolute path, ``..``, NUL, ``\\``)."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise DatasetError(f"{where}: file name {name!r} is not a plain relative name")
    # as Path(name).is_absolute() and Path(name).parts on POSIX, without a Path: manifests list millions of names
    if name.startswith(("/", "~")) or ".." in name.split("/"):
        raise DatasetError(f"{where}: file name {name!r} points outside the dataset directory")
    return name


def check_class_name(name: object, where: str) -> str:
    """A class name that is one plain folder name (``packer extract`` makes a folder of it under DIR): a non-empty
    string, not ``.`` or ``..``, without ``/``, ``\\`` or NUL; else a PackerError naming the class and ``where``."""
    why = class_name_problem(name)
    if why is not None or not isinstance(name, str):
        raise PackerError(f"{where}: class name {name!r} {why}: a class name must be one plain folder name")
    return name


def class_name_problem(name: object) -> str | None:
    """Why ``name`` can't be a class name ("holds a path separator '/'"), or None."""
    if not isinstance(name, str):
        return "is not a string"
    if not name:
        return "is empty"
    for bad, why in (("\x00", "holds a NUL byte"), ("/", "holds a path separator '/'"), ("\\", "holds a backslash")):
        if bad in name:
            return why
    return "names the folder itself or the one above" if name in (".", "..") else None


def inside(root: Path, name: str, where: str | None = None, must_exist: bool = True) -> Path:
    """``root/name``, refusing a name or a symlink that leads out of ``root`` and anything but a regular file.

    The dataset directory itself may be a symlink (data on another disk); what is inside it
    may not point elsewhere, so a dataset can only ever read its own files.
    """
    where = where or str(root)
    check_inner_name(name, where)
    path = root / name
    try:
        real_root = root.resolve(strict=True)
        real = path.resolve(strict=must_exist)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        if isinstance(exc, FileNotFoundError):
            raise DatasetError(f"{path}: missing") from None
        raise DatasetError(f"{path}: cannot resolve ({exc})") from None
    if real != real_root and real_root not in real.parents:
        raise DatasetError(f"{path}: leads outside the dataset directory (to {real}); refusing to read it")
    if must_exist:
        try:
            mode = os.stat(real).st_mode
        except OSError as exc:
            raise DatasetError(f"{path}: cannot stat ({exc.strerror or exc})") from None
        if not stat.S_ISREG(mode):
            raise DatasetError(f"{path}: not a regular file")
    return path


def json_kind(path: str | os.PathLike, max_bytes: int) -> object:
    """The ``kind`` entry of the small JSON object at ``path`` (None: missing, special, larger than ``max_bytes``,
    not JSON or not an object): how a folder is recognised as packer's (a dataset, an export) without trusting it."""
    try:
        fd, st = open_regular(path)
    except OSError:
        return None
    try:
        if st.st_size > max_bytes:
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = json.loads(fh.read())
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    return data.get("kind") if isinstance(data, dict) else None


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` (links followed) and its ``fstat``; anything but a regular file is refused.

    The one way packer opens a source file: non-blocking, so a FIFO (which would block forever
    waiting for a writer) or a device is never waited on; raises OSError "not a regular file".
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_inside(root: Path, name: str, max_bytes: int, where: str | None = None) -> bytes:
    """The bytes of the regular file ``root/name`` (checked by ``inside``), refused beyond ``max_bytes``.

    Opened non-blocking and checked again on the open file, so a FIFO or device put there after
    the check can't make the read hang, and nothing larger than ``max_bytes`` is read into memory.
    """
    path = inside(root, name, where)
    try:
        fd, st = open_regular(path)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot open ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > max_bytes:
            raise DatasetError(f"{path}: implausibly large ({st.st_size} bytes, at most {max_bytes} expected)")
        try:
            data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise DatasetError(f"{path}: grew past {max_bytes} bytes while being read")
    return data


def npy_header(path: Path, dtype: str, ndim: int | None = None) -> tuple[tuple[int, ...], int]:
    """(shape, data offset) of a ``.npy`` holding exactly ``dtype`` in C order, its size checked against the file.

    ``np.load`` alone trusts the header: a crafted shape makes it allocate what the header
    says, not what the file holds. Here the file must hold exactly header + shape x itemsize.
    """
    want = np.dtype(dtype)
    try:
        size = os.stat(path).st_size
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, found = np.lib.format.read_array_header_1_0(fh, max_header_size=10_000)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, found = np.lib.format.read_array_header_2_0(fh, max_header_size=10_000)
            else:
                raise ValueError(f"unsupported .npy version {version}")
            offset = fh.tell()
    except (OSError, ValueError, EOFError, SyntaxError, TypeError, KeyError, tokenize.TokenError) as exc:
        raise DatasetError(f"{path}: not a valid .npy file ({type(exc).__name__}: {exc})") from exc
    if found != want or found.hasobject:
        raise DatasetError(f"{path}: holds {found}, expected {want}")
    if ndim is not None and len(shape) != ndim:
        raise DatasetError(f"{path}: shape {shape}, expected {ndim} dimensions")
    if fortran and len(shape) > 1:
        raise DatasetError(f"{path}: Fortran-ordered array, expected C order")
    count = 1
    for n in shape:
        count *= int(n)  # Python ints: a crafted shape can't overflow into a small size
    if count * want.itemsize != size - offset:
        raise DatasetError(f"{path}: header promises {count * want.itemsize} bytes of data, "
                           f"the file holds {size - offset}")
    return tuple(int(n) for n in shape), offset


def load_npy(path: Path, dtype: str, ndim: int | None = 1, max_items: int | None = None) -> np.ndarray:
    """A ``.npy`` of exactly ``dtype`` read into memory after ``npy_header`` checked it (never pickle)."""
    shape, offset = npy_header(path, dtype, ndim)
    count = 1
    for n in shape:
        count *= n
    if max_items is not None and count > max_items:
        raise DatasetError(f"{path}: {count} entries, at most {max_items} expected")
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            arr = np.fromfile(fh, dtype=np.dtype(dtype), count=count)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{path}: cannot read ({exc})") from exc
    if arr.size != count:
        raise DatasetError(f"{path}: truncated while reading")
    return arr.reshape(shape)


def check_offsets(offsets: np.ndarray, total: int, where: str, count: int | None = None) -> None:
    """``offsets`` ([N+1], from 0, non-decreasing, ending at ``total``) describe a blob of ``total`` bytes."""
    if offsets.ndim != 1 or len(offsets) < 1 or (count is not None and len(offsets) != count + 1):
        raise DatasetError(f"{where}: {len(offsets)} offsets, expected {'N+1' if count is None else count + 1}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != total or bool(np.any(np.diff(offsets) < 0)):
        raise DatasetError(f"{where}: offsets do not describe the {total} bytes they index "
                           "(negative, decreasing or past the end)")
