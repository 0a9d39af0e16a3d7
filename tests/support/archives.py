"""Compressed tars crafted in the test: a member that inflates like a bomb, a member that lies about its size.

Built as bytes, not by ``tarfile`` over real data: a 2 GiB run of zeros is deflated once per MiB with a full
flush (which makes every MiB's deflate bytes the same), so the archive is ~2 MB and is made in about a second.
"""

from __future__ import annotations

import struct
import tarfile
import zlib
from pathlib import Path

MIB = 1 << 20


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """Headers and data of ``members`` as a tar holds them (no end-of-archive blocks)."""
    out = []
    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        out.append(info.tobuf(format=tarfile.GNU_FORMAT) + data + bytes(-len(data) % 512))
    return b"".join(out)


def header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    return info.tobuf(format=tarfile.GNU_FORMAT)


def zero_bomb_tgz(path: Path, before: list[tuple[str, bytes]], bomb: str, mib: int,
                  after: list[tuple[str, bytes]]) -> Path:
    """A .tar.gz of ``before``, member ``bomb`` of ``mib`` MiB of zeros, ``after``: the gzip stream written by hand
    (header, raw deflate, CRC-32 and length), so the zeros are never all in memory."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = tar_bytes(before) + header(bomb, mib * MIB)
    tail = tar_bytes(after) + bytes(1024)
    zeros = bytes(MIB)
    first = comp.compress(head) + comp.flush(zlib.Z_FULL_FLUSH)
    block = comp.compress(zeros) + comp.flush(zlib.Z_FULL_FLUSH)
    again = comp.compress(zeros) + comp.flush(zlib.Z_FULL_FLUSH)
    assert block == again  # each MiB of zeros deflates to the same bytes after a full flush
    crc = zlib.crc32(head)
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    crc = zlib.crc32(tail, crc)
    last = comp.compress(tail) + comp.flush()
    with open(path, "wb") as fh:
        fh.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + first)
        for _ in range(mib - 1):  # the second of two identical blocks was deflated once already
            fh.write(block)
        fh.write(again + last + struct.pack("<II", crc, (len(head) + mib * MIB + len(tail)) & 0xFFFFFFFF))
    return path


def lying_tgz(path: Path, before: list[tuple[str, bytes]], liar: str, declared: int, data: bytes) -> Path:
    """A .tar.gz of ``before`` then member ``liar`` whose header declares ``declared`` bytes, followed by only
    ``data`` and the end of the archive."""
    path.write_bytes(zlib.compress(tar_bytes(before) + header(liar, declared) + data, wbits=31))
    return path
