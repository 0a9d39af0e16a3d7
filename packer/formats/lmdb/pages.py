"""An LMDB file's B-tree read page by page with ``pread``: the header (the newest meta page: page size, last page,
transaction, entry count), its root, branch pages down to a key's leaf, and each leaf node's value (where it lies
in the file and how long it is). py-lmdb is not needed to read a shard, so a ``lmdb.Environment`` the user holds
open on it (py-lmdb refuses to open a file twice in one process) is no obstacle.

Positioning py-lmdb's cursor touches the value's first overflow page too: on a cold open under the emulated
hard disk, checking 8 samples' spans that way cost 21 device reads (a leaf page and a value page each). Read
here, a check costs the root, the branch pages and the leaves it compares (``packer bench`` measured in
docs/results.md), and values are never touched. Every number read from the file is checked before use: a
crafted file gets a one-line ``PackerError``, never a read outside the file or a walk that does not end.

Read with ``pread`` (a read error or a file cut short is an error, where a map would kill the process with
SIGBUS), under ``page_reads``: a cold page next to the last one read brought in 5 without it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from packer.errors import DatasetError, PackerError

PAGE_HEADER = 16  # MDB_page: page number, pad, flags, lower, upper (64-bit builds)
PAGE_FLAGS = struct.Struct("<8xHHHH")  # pad, flags, lower (end of the node offsets), upper
NODE = struct.Struct("<HHHH")  # MDB_node: lo, hi (data size, or with flags a branch's child page), flags, key size
BRANCH, LEAF, META_PAGE = 0x01, 0x02, 0x08  # page flags
BIGDATA = 0x01  # leaf node flag: the value lies in overflow pages, the node holds the first one's number
META_MAGIC, META_VERSION = 0xBEEFC0DE, 1
META = struct.Struct("<II")  # at PAGE_HEADER: magic, version
MAIN_DB = struct.Struct("<IHHQQQQQ")  # at 88: pad, flags, depth, branch/leaf/overflow pages, entries, root
MAIN_DB_AT, LAST_PAGE_AT, TXNID_AT = 88, 136, 144
PSIZE_AT = 40  # the free database's md_pad: the page size
META_BYTES = 152  # the meta record, from the page's start
MAX_PAGE = 1 << 16  # LMDB's MAX_PAGESIZE
MAX_DEPTH = 32  # LMDB's own cursor stack (CURSOR_STACK)
MIN_PAGE = 256  # smaller pages cannot hold a meta record (152 bytes); LMDB itself accepts a crafted 16


@contextmanager
def page_reads(fd: int) -> Iterator[None]:
    """The kernel's read-ahead off for ``fd`` while pages are read one by one, back to normal after. (It still
    acts on a page another read left a read-ahead mark on: ``Reader`` reads the header pages first for that.)"""
    _advise(fd, "POSIX_FADV_RANDOM")
    try:
        yield
    finally:
        _advise(fd, "POSIX_FADV_NORMAL")


def _advise(fd: int, advice: str) -> None:
    """Advice where the OS takes it (none on macOS; a filesystem may refuse it): reads are right either way."""
    if hasattr(os, advice):
        try:
            os.posix_fadvise(fd, 0, 0, getattr(os, advice))
        except OSError:
            pass


@dataclass(frozen=True)
class Header:
    """What LMDB reads of a file when it opens it: from the newest of its two meta pages."""

    psize: int
    last_pgno: int
    txnid: int
    entries: int


def read_header(fd: int, path: Path) -> Header:
    """The header of the LMDB file at ``fd``, as ``mdb_env_read_header`` reads it: meta page 0 at byte 0, meta page 1
    one page (meta 0's page size) further, the one of the larger transaction (meta 0 on a tie) deciding. A file
    that is no LMDB file, or whose numbers cannot be, gets a PackerError naming it."""
    first = _meta_record(fd, 0)
    second = None if first is None or not MIN_PAGE <= first[0] <= MAX_PAGE else _meta_record(fd, first[0])
    if first is None or second is None:
        raise PackerError(f"{path}: damaged, not a valid LMDB file (MDB_INVALID: its header pages are not LMDB's)")
    psize, last_pgno, txnid, entries = second if second[2] > first[2] else first
    if psize < MIN_PAGE or psize > MAX_PAGE or psize & (psize - 1):
        raise PackerError(f"{path}: damaged LMDB shard (a page size of {psize} bytes)")
    return Header(psize, last_pgno, txnid, entries)


def _meta_record(fd: int, offset: int) -> tuple[int, int, int, int] | None:
    """(page size, last page, transaction, entries) of the meta page at ``offset``, None where there is none."""
    raw = os.pread(fd, META_BYTES, offset)
    if len(raw) < META_BYTES or not PAGE_FLAGS.unpack_from(raw)[1] & META_PAGE or \
            META.unpack_from(raw, PAGE_HEADER) != (META_MAGIC, META_VERSION):
        return None
    (psize,) = struct.unpack_from("<I", raw, PSIZE_AT)
    entries = MAIN_DB.unpack_from(raw, MAIN_DB_AT)[6]
    (last_pgno,) = struct.unpack_from("<Q", raw, LAST_PAGE_AT)
    (txnid,) = struct.unpack_from("<Q", raw, TXNID_AT)
    return psize, last_pgno, txnid, entries


@dataclass(frozen=True)
class Node:
    key: bytes
    start: int  # the value's first byte in the file
    nbytes: int


class Tree:
    """The main database's B-tree of one LMDB file open at ``fd``, as its newest meta page describes it
    (the one LMDB itself reads: ``txnid`` must match what py-lmdb reports)."""

    def __init__(self, fd: int, path: Path, psize: int, txnid: int) -> None:
        self.fd, self.path, self.psize = fd, path, psize
        self.file_size = os.fstat(fd).st_size
        if psize < MIN_PAGE or psize & (psize - 1):  # a meta page must hold the fields read below
            raise self._damaged(f"a page size of {psize} bytes")
        first, second = self._meta(0), self._meta(1)
        # LMDB reads the meta with the larger transaction id, meta page 0 on a tie
        txn, depth, pages, entries, root = second if second[0] > first[0] else first
        if txn != txnid:
            raise self._damaged(f"its newest meta page is transaction {txn}, LMDB reads {txnid}")
        if not 0 < depth <= MAX_DEPTH and (depth, entries) != (0, 0):  # an empty tree has no root page
            raise self._damaged(f"a B-tree {depth} levels deep holding {entries} entries")
        self.depth, self.pages, self.entries, self.root = depth, pages, entries, root

    def _damaged(self, why: str) -> PackerError:
        return DatasetError(f"{self.path}: damaged LMDB shard ({why})")

    def _meta(self, n: int) -> tuple[int, int, int, int, int]:
        page = self._read(n)
        magic, version = META.unpack_from(page, PAGE_HEADER)
        if magic != META_MAGIC or version != META_VERSION:
            raise self._damaged(f"meta page {n} is not LMDB's")
        _pad, _flags, depth, branch, leaf, _overflow, entries, root = MAIN_DB.unpack_from(page, MAIN_DB_AT)
        (txnid,) = struct.unpack_from("<Q", page, TXNID_AT)
        return txnid, depth, branch + leaf, entries, root

    def _read(self, pgno: int) -> bytes:
        if not 0 <= pgno < self.file_size // self.psize:
            raise self._damaged(f"page {pgno} lies past the end of the file")
        page = os.pread(self.fd, self.psize, pgno * self.psize)
        if len(page) != self.psize:
            raise self._damaged(f"page {pgno} is short")
        return page

    def _page(self, pgno: int, kind: int) -> tuple[bytes, list[int]]:
        """Page ``pgno`` and its nodes' offsets in it, the page seen to be a ``kind`` page."""
        page = self._read(pgno)
        _pad, flags, lower, upper = PAGE_FLAGS.unpack_from(page)
        if flags != kind or not PAGE_HEADER <= lower <= upper <= self.psize or lower % 2:
            raise self._damaged(f"page {pgno} is not an LMDB {'leaf' if kind == LEAF else 'branch'} page")
        offsets = list(struct.unpack_from(f"<{(lower - PAGE_HEADER) // 2}H", page, PAGE_HEADER))
        if not offsets or any(not upper <= o <= self.psize - NODE.size for o in offsets):
            raise self._damaged(f"page {pgno} holds a node outside it")
        return page, offsets

    def _node(self, page: bytes, at: int, pgno: int) -> tuple[int, int, int, int, bytes]:
        lo, hi, flags, ksize = NODE.unpack_from(page, at)
        if at + NODE.size + ksize > self.psize:
            raise self._damaged(f"page {pgno} holds a key past its end")
        return lo, hi, flags, ksize, page[at + NODE.size : at + NODE.size + ksize]

    def _children(self, pgno: int) -> list[tuple[bytes, int]]:
        """A branch page's (first key, child page) pairs; the first key is empty (LMDB leaves it implicit)."""
        page, offsets = self._page(pgno, BRANCH)
        out = []
        for at in offsets:
            lo, hi, flags, _ksize, k = self._node(page, at, pgno)
            out.append((k, lo | hi << 16 | flags << 32))
        return out

    def leaf(self, pgno: int) -> list[Node]:
        """A leaf page's nodes, in key order."""
        page, offsets = self._page(pgno, LEAF)
        nodes = []
        for at in offsets:
            lo, hi, flags, ksize, k = self._node(page, at, pgno)
            nbytes, data = lo | hi << 16, at + NODE.size + ksize
            if flags & ~BIGDATA:  # a sub-database or duplicates: not a packer shard's node
                raise self._damaged(f"page {pgno} holds a node of flags {flags:#x}, not a plain value")
            if flags & BIGDATA:
                if data + 8 > self.psize:
                    raise self._damaged(f"page {pgno} holds a node past its end")
                (first,) = struct.unpack_from("<Q", page, data)
                start = first * self.psize + PAGE_HEADER
            else:
                if data + nbytes > self.psize:
                    raise self._damaged(f"page {pgno} holds a value past its end")
                start = pgno * self.psize + data
            if not 0 <= start <= self.file_size - nbytes:
                raise self._damaged(f"the value of key {_shown(k)} runs past the end of the file")
            nodes.append(Node(k, start, nbytes))
        return nodes

    def leaf_of(self, key: bytes) -> int:
        """The page number of the leaf that holds ``key`` if the tree holds it: one page read per level."""
        pgno = self.root
        for _ in range(self.depth - 1):
            children = self._children(pgno)
            pgno = children[0][1]
            for k, child in children[1:]:
                if k > key:
                    break
                pgno = child
        return pgno

    def leaves(self) -> Iterator[tuple[int, list[Node]]]:
        """Every leaf page (number, nodes), in key order: a depth-first walk of at most the pages the meta
        page counts and the file holds (a crafted loop of branch pages ends there)."""
        stack, seen, limit = [(self.root, 1)] if self.depth else [], 0, min(self.pages, self.file_size // self.psize)
        while stack:
            pgno, level = stack.pop()
            seen += 1
            if seen > limit:
                raise self._damaged("its B-tree holds more pages than its meta page counts")
            if level == self.depth:
                yield pgno, self.leaf(pgno)
            else:
                stack.extend((child, level + 1) for _k, child in reversed(self._children(pgno)))


def _shown(key: bytes) -> str:
    """A key for a one-line message: packer's ten digits as they are, anything else escaped (and cut short)."""
    return key.decode() if key.isdigit() and len(key) <= 20 else repr(key[:40])
