"""Crafted LMDB files against values read as views: a PackerError in one line, never SIGBUS.

Each read runs in a child process: a SIGBUS there is a failed test, not a dead test run. The child is forked
(tests/support/memlimit.py: it starts at once), or a fresh interpreter where the read must find no /proc.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest
from support.fuzzing import _rewrite_checksums
from support.imagesets import make_imagefolder
from support.memlimit import limited_call

from packer import Writer, convert

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """An LMDB dataset of 8 values of ~40 KB (overflow pages, as photos are): one shard."""
    root = tmp_path_factory.mktemp("lmdbattack")
    src = make_imagefolder(root / "src", classes=2, per_class=4, size=(24, 32))
    for k, jpg in enumerate(sorted(src.rglob("*.jpg"))):
        jpg.write_bytes(jpg.read_bytes() + bytes([k % 251]) * 40_000)  # bytes after the JPEG's end are ignored
    return convert(src, root / "base", to="lmdb", workers=0, progress=False).output


def overflow_past_the_end(base: Path, out: Path, pos: int) -> Path:
    """A copy whose sample ``pos`` (a BIGDATA node) names the file's last page as its first overflow page: a
    valid page number, but the value's ~40 KB run past the end of the file (LMDB maps beyond it)."""
    shutil.copytree(base, out)
    shard = out / "shard-00000.lmdb"
    env = lmdb.open(str(shard), subdir=False, readonly=True, lock=False)
    last = env.info()["last_pgno"]
    env.close()
    data = bytearray(shard.read_bytes())
    k = bytes(data).index(b"%010d" % pos)
    _lo, _hi, flags, ksize = struct.unpack_from("<HHHH", data, k - 8)
    assert flags & 1, "the value is not in overflow pages"
    struct.pack_into("<Q", data, k + ksize, last)
    shard.write_bytes(bytes(data))
    _rewrite_checksums(out)
    return out


def _payload_error(path: Path, pos: int) -> str:
    """What reading stored position ``pos`` prints, as the child of read_in_child: the PackerError, or nothing."""
    from packer import PackerError, open_dataset

    try:
        open_dataset(path).payloads_at([pos])
    except PackerError as e:
        return f"{e}\n"
    return ""


def _payload_digest(path: Path, pos: int) -> str:
    from packer import open_dataset

    return hashlib.sha256(open_dataset(path).payloads_at([pos])[0]).hexdigest()


def read_in_child(path: Path, pos: int, prelude: str = "") -> subprocess.CompletedProcess:
    """Stored position ``pos`` read in a child: the PackerError it printed on stdout, its exit code (a signal's
    negative number: SIGBUS is -7). Forked; a fresh interpreter when ``prelude`` (code run before packer loads)."""
    if not prelude:
        kind, got = limited_call(_payload_error, path, pos)
        if kind == "ok":
            return subprocess.CompletedProcess([], 0, str(got), "")
        return subprocess.CompletedProcess([], -1 if kind == "died" else 1, "", f"{kind}: {got}")
    code = (f"{prelude}\nfrom packer import PackerError, open_dataset\n"
            f"try:\n    open_dataset({str(path)!r}).payloads_at([{pos}])\nexcept PackerError as e:\n    print(e)\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_an_overflow_value_past_the_end_is_refused_without_touching_it(big, tmp_path):
    """A checked sample whose overflow page runs past the end of the file: the spans check decodes its leaf node
    (packer.formats.lmdb.pages) and refuses the shard in one line, without /proc (opening /proc/self/maps
    fails in the child) and without touching the value (py-lmdb would fault on it: SIGBUS, rc -7)."""
    path = overflow_past_the_end(big, tmp_path / "ds", pos=7)
    no_proc = ("import builtins; _open = builtins.open\n"
               "def guarded(f, *a, **k):\n"
               "    if str(f).startswith('/proc'): raise OSError('no /proc here')\n"
               "    return _open(f, *a, **k)\n"
               "builtins.open = guarded")
    for prelude in ("", no_proc):
        got = read_in_child(path, 0, prelude)
        assert got.returncode == 0 and "value of key 0000000007 runs past the end" in got.stdout and (
            "shard-00000" in got.stdout), (
            got.returncode, got.stdout, got.stderr[-300:])


def drop_spans(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    for shard in manifest["shards"]:
        (path / shard["files"][1]["name"]).unlink()
        shard["files"] = shard["files"][:1]
    (path / "manifest.json").write_text(json.dumps(manifest))
    _rewrite_checksums(path)


def test_a_shard_without_spans_refuses_an_overflow_value_past_the_end(big, tmp_path):
    """Written before spans files existed: the walk of the leaf pages that finds the values refuses the one past
    the end of the file in one line (py-lmdb, which served such shards before, faulted on it: SIGBUS)."""
    path = overflow_past_the_end(big, tmp_path / "ds", pos=7)
    drop_spans(path)
    got = read_in_child(path, 0)
    assert got.returncode == 0 and "value of key 0000000007 runs past the end" in got.stdout, (
        got.returncode, got.stdout, got.stderr[-300:])


@pytest.mark.parametrize("craft, message", [
    ("root past the end", "lies past the end of the file"),
    ("root on a value page", "is not an LMDB leaf page"),
    ("too deep", "levels deep"),
])
def test_a_crafted_btree_is_refused_in_one_line(big, tmp_path, craft, message):
    """The meta pages' main tree (read by packer.formats.lmdb.pages with pread, not through a map) made to point
    past the file, at a value's page, or 40 levels deep: one line naming the shard, never a crash or a hang."""
    out = tmp_path / "ds"
    shutil.copytree(big, out)
    shard = out / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    psize = 4096
    value_page = struct.unpack_from("<Q", data, bytes(data).index(b"%010d" % 3) + 10)[0]
    for meta in (0, psize):  # both meta pages: whichever LMDB picks
        if craft == "too deep":
            struct.pack_into("<H", data, meta + 94, 40)
        else:
            struct.pack_into("<Q", data, meta + 128, len(data) // psize + 10 if craft == "root past the end"
                             else value_page)
    shard.write_bytes(bytes(data))
    _rewrite_checksums(out)
    got = read_in_child(out, 0)
    assert got.returncode == 0 and message in got.stdout and "shard-00000" in got.stdout, (
        got.returncode, got.stdout, got.stderr[-300:])
    assert got.stdout.count("\n") == 1


def test_a_loop_of_branch_pages_ends_in_one_line(tmp_path):
    """A root branch page whose every child is its first leaf, the meta pages claiming 2**40 pages: the walk of
    the leaves (a shard without spans) ends in one line, never a walk of 2**40 pages."""
    src = tmp_path / "src"
    with Writer(src, format="lmdb") as w:
        for i in range(400):
            w.add(np.full((1, 1, 3), i % 251, np.uint8), label=0)
    env = lmdb.open(str(src / "shard-00000.lmdb"), subdir=False, readonly=True, lock=False)
    assert env.stat()["depth"] == 2
    env.close()
    drop_spans(src)
    shard = src / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    psize = 4096
    root = struct.unpack_from("<Q", data, 128)[0]
    if struct.unpack_from("<Q", data, psize + 144)[0] > struct.unpack_from("<Q", data, 144)[0]:
        root = struct.unpack_from("<Q", data, psize + 128)[0]
    page = root * psize
    lower = struct.unpack_from("<H", data, page + 12)[0]
    first = page + struct.unpack_from("<H", data, page + 16)[0]
    leaf = data[first : first + 6]
    for k in range(1, (lower - 16) // 2):  # every child of the root: its first leaf
        at = page + struct.unpack_from("<H", data, page + 16 + 2 * k)[0]
        data[at : at + 6] = leaf
    for meta in (0, psize):
        struct.pack_into("<QQ", data, meta + 96, 1 << 40, 1 << 40)  # branch and leaf page counts
    shard.write_bytes(bytes(data))
    _rewrite_checksums(src)
    got = read_in_child(src, 0)
    assert got.returncode == 0 and "shard-00000" in got.stdout and got.stdout.count("\n") == 1, (
        got.returncode, got.stdout, got.stderr[-300:])


def test_a_crafted_key_stays_on_one_line(big, tmp_path):
    """A value past the end under a key holding a newline: the message shows the key escaped, on one line."""
    path = overflow_past_the_end(big, tmp_path / "ds", pos=7)
    shard = path / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    k = bytes(data).index(b"%010d" % 7)
    data[k + 9] = ord("\n")
    shard.write_bytes(bytes(data))
    _rewrite_checksums(path)
    got = read_in_child(path, 0)
    assert got.returncode == 0 and "value of key b'000000000\\n' runs past the end" in got.stdout, (
        got.returncode, got.stdout, got.stderr[-300:])
    assert got.stdout.count("\n") == 1


def test_meta_pages_of_one_transaction_are_read_as_lmdb_reads_them(big, tmp_path):
    """Both meta pages claiming the same transaction, the second naming a root past the end: LMDB reads the
    first, and so does packer (taking the larger of the two whole records picked the second)."""
    out = tmp_path / "ds"
    shutil.copytree(big, out)
    shard = out / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    psize = 4096
    newer = 0 if struct.unpack_from("<Q", data, 144)[0] >= struct.unpack_from("<Q", data, psize + 144)[0] else 1
    page = bytes(data[newer * psize : (newer + 1) * psize])
    data[0:psize], data[psize : 2 * psize] = page, page
    struct.pack_into("<Q", data, 0, 0)
    struct.pack_into("<Q", data, psize, 1)  # each meta page's own number
    struct.pack_into("<Q", data, psize + 128, len(data) // psize + 10)  # the second's root: past the end
    shard.write_bytes(bytes(data))
    _rewrite_checksums(out)
    env = lmdb.open(str(shard), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        expected = txn.get(b"%010d" % 5)
    env.close()
    kind, got = limited_call(_payload_digest, out, 5)  # in a forked child: a fault there fails the test only
    assert (kind, got) == ("ok", hashlib.sha256(expected).hexdigest())


def test_a_tiny_page_size_is_refused_by_name(big, tmp_path):
    """A newest meta page claiming 16-byte pages (py-lmdb opens it): refused as such, in one line."""
    out = tmp_path / "ds"
    shutil.copytree(big, out)
    shard = out / "shard-00000.lmdb"
    data = bytearray(shard.read_bytes())
    struct.pack_into("<I", data, 4096 + 40, 16)  # meta page 1's mm_psize (the free database's md_pad)
    struct.pack_into("<Q", data, 120, 8)  # meta page 0's entry count: py-lmdb then opens the file
    shard.write_bytes(bytes(data))
    _rewrite_checksums(out)
    got = read_in_child(out, 0)
    assert got.returncode == 0 and got.stdout.count("\n") == 1 and "shard-00000" in got.stdout, (
        got.returncode, got.stdout, got.stderr[-300:])
    assert "page size of 16 bytes" in got.stdout, got.stdout
