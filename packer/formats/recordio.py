"""RecordIO: MXNet's indexed record files, a ``.rec`` + ``.idx`` pair per shard, byte for byte as
``mxnet.recordio.MXIndexedRecordIO`` writes them, so MXNet/GluonCV (``ImageRecordIter``,
``ImageRecordDataset``) and DALI's ``fn.readers.mxnet`` read packer's output unchanged.

| file              | holds                                                                       |
|-------------------|-----------------------------------------------------------------------------|
| shard-00000.rec   | the records, back to back, each starting at a multiple of 4 bytes           |
| shard-00000.idx   | text, one line per record: ``key<TAB>offset<LF>`` (key = position in the     |
|                   | shard, offset = where the record starts in the .rec), in record order       |

One record (all integers little-endian, as MXNet writes them on every platform it runs on):

| bytes        | field                                                                        |
|--------------|------------------------------------------------------------------------------|
| 4            | magic ``0xced7230a``                                                         |
| 4            | ``lrecord``: ``cflag << 29 | length`` (cflag in the upper 3 bits, length of   |
|              | this part's data in the lower 29)                                            |
| length       | data: the IRHeader ``struct.pack('<IfQQ', flag, label, id, id2)`` (24 bytes; |
|              | flag 0 = one float label, k > 0 = k float labels follow the header), then the |
|              | image file's bytes                                                           |
| 0-3          | zeros up to a multiple of 4                                                   |

As dmlc-core's ``RecordIOWriter`` does, a record whose data hold the magic at a 4-byte-aligned position is split
there into parts (cflag 1 = first, 2 = middle, 3 = last; 0 = a whole record), the magic dropped from the data and
restored by readers between parts; only the last part is padded, and a record holds at most 2^29 - 1 bytes. Packer
writes ``flag = 0``, ``label = float(class index)`` (-1.0 in a flat folder), ``id`` = position, ``id2 = 0``, encoded
payloads only. Reading checks the ``.idx`` and each record's parts against its span before allocating anything.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from packer.errors import DatasetError, OptionError, PackerError
from packer.formats.base import (
    Destinations,
    Format,
    PreparedSample,
    ShardReader,
    ShardWriter,
    Span,
    check_addition,
    pread_ranges,
)
from packer.formats.filemap import check_size, closed_on_error, map_readonly, open_checked
from packer.layout.manifest import Shard
from packer.perprocess import PerProcess

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
MAX_LENGTH = (1 << 29) - 1  # the lower 29 bits of lrecord
IR_FORMAT = "<IfQQ"  # flag, label, id, id2: mxnet.recordio's 'IfQQ' on the little-endian machines it runs on
IR_SIZE = struct.calcsize(IR_FORMAT)  # 24
_IDX_LINE_MAX = 64  # "key\toffset\n": two integers of at most 20 digits


def shard_stem(shard_id: int) -> str:
    return f"shard-{shard_id:05d}"


def _pad(n: int) -> int:
    return -n % 4


def encode_record(data: bytes | memoryview) -> list[bytes | memoryview]:
    """The pieces that ``dmlc::RecordIOWriter::WriteRecord`` writes for ``data``, in order.

    Split where the magic occurs at a 4-byte-aligned position of ``data`` (dropped there), each
    part behind its own magic and ``lrecord``; zeros pad only the last part.
    """
    n = len(data)
    if n > MAX_LENGTH:
        raise PackerError(f"a RecordIO record holds at most {MAX_LENGTH} bytes, this one {n}")
    words = np.frombuffer(data, dtype="<u4", count=n // 4)
    cuts = np.flatnonzero(words == MAGIC) * 4
    out: list[bytes | memoryview] = []
    start = 0
    for cut in cuts.tolist():
        out += [_MAGIC_BYTES, struct.pack("<I", (1 if start == 0 else 2) << 29 | (cut - start)), data[start:cut]]
        start = cut + 4
    out += [_MAGIC_BYTES, struct.pack("<I", (3 if start else 0) << 29 | (n - start)), data[start:], b"\0" * _pad(n)]
    return out


def decode_record(buf: bytes | memoryview, where: object) -> memoryview:
    """The data of the one record that fills ``buf`` exactly (its parts joined, magics restored).

    Every length is checked against ``buf`` before use: a crafted record gives PackerError.
    """
    view = memoryview(buf)
    parts: list[memoryview] = []
    pos, expect_more = 0, False
    while True:
        if pos + 8 > len(view):
            raise DatasetError(f"{where}: record ends inside a part header")
        magic, lrec = struct.unpack_from("<II", view, pos)
        cflag, length = lrec >> 29, lrec & MAX_LENGTH
        if magic != MAGIC:
            raise DatasetError(f"{where}: bad RecordIO magic {magic:#010x} at byte {pos} of the record")
        if cflag > 3 or (cflag in (0, 1)) == expect_more:
            raise DatasetError(f"{where}: RecordIO part flag {cflag} out of sequence")
        end = pos + 8 + length
        if end + (_pad(length) if cflag in (0, 3) else 0) > len(view):
            raise DatasetError(f"{where}: RecordIO part of {length} bytes runs past the record's end")
        parts.append(view[pos + 8 : end])
        pos, expect_more = end, cflag in (1, 2)
        if not expect_more:
            break
    if pos + _pad(length) != len(view):
        raise DatasetError(f"{where}: {len(view) - pos} bytes between the record's end and the next record")
    if len(parts) == 1:
        return parts[0]
    return memoryview(_MAGIC_BYTES.join(bytes(p) for p in parts))


def pack_header(label: float, id: int, id2: int = 0) -> bytes:
    """``mxnet.recordio.pack``'s header for a single float label."""
    return struct.pack(IR_FORMAT, 0, label, id, id2)


def image_bounds(head: bytes, size: int) -> tuple[int, int] | None:
    """Where the image bytes of a record of ``size`` bytes lie in it, from its first ``HEAD_BYTES`` (``head``):
    a record of one part whose lengths all agree; None for any other (in parts, or damaged: read it whole, and
    ``decode_record`` and ``unpack_header`` join it or say what is wrong)."""
    if len(head) < HEAD_BYTES:
        return None
    magic, lrec, flag = struct.unpack_from("<III", head)
    length = lrec & MAX_LENGTH
    if magic != MAGIC or lrec >> 29 or 8 + length + _pad(length) != size or IR_SIZE + 4 * flag > length:
        return None
    return HEAD_BYTES + 4 * flag, 8 + length


HEAD_BYTES = 8 + IR_SIZE  # a record's part header and image header: what ``image_bounds`` reads


def unpack_header(data: memoryview, where: object) -> tuple[float | tuple[float, ...], int, int, memoryview]:
    """(label or labels, id, id2, the image bytes) of a record's data, as ``mxnet.recordio.unpack``."""
    if len(data) < IR_SIZE:
        raise DatasetError(f"{where}: record of {len(data)} bytes is shorter than its {IR_SIZE}-byte header")
    flag, label, id_, id2 = struct.unpack_from(IR_FORMAT, data)
    if flag == 0:
        return label, id_, id2, data[IR_SIZE:]
    if IR_SIZE + 4 * flag > len(data):
        raise DatasetError(f"{where}: header announces {flag} labels, more than the record holds")
    labels = tuple(np.frombuffer(data, "<f4", count=flag, offset=IR_SIZE).tolist())
    return labels, id_, id2, data[IR_SIZE + 4 * flag :]


class Writer(ShardWriter):
    def __init__(self, directory: Path, shard_id: int, num_samples: int, payload: str, options: Mapping) -> None:
        super().__init__(directory, shard_id, num_samples, payload, options)
        if payload != "encoded":
            raise OptionError("the recordio format stores encoded image files (MXNet and DALI decode them)")
        stem = shard_stem(shard_id)
        self.names = [f"{stem}.rec", f"{stem}.idx"]
        self.path = self.directory / self.names[0]
        self._count = 0
        self._lines: list[str] = []
        self._rec = open(self.path, "wb")  # OSError (disk full) propagates: the driver reports it

    def add(self, sample: PreparedSample) -> None:
        check_addition(self.path, self._count, self.planned, sample, None)
        self._lines.append(f"{self._count}\t{self._rec.tell()}\n")
        data = pack_header(float(sample.label), self._count) + bytes(sample.payload)
        self._rec.writelines(encode_record(data))
        self._count += 1

    def close(self) -> tuple[list[str], dict]:
        self._rec.close()
        with open(self.directory / self.names[1], "w", encoding="ascii", newline="\n") as fh:
            fh.writelines(self._lines)
        return list(self.names), {}

    def abort(self) -> None:
        try:
            self._rec.close()
        except OSError:
            pass  # a full disk fails the flush again: the files go anyway
        for name in self.names:
            (self.directory / name).unlink(missing_ok=True)


# ---------------------------------------------------------------- reading


def read_index(idx_path: str | os.PathLike, rec_size: int,
               max_records: int | None = None) -> tuple[list[str], np.ndarray]:
    """(keys, offsets) of an ``.idx`` file in record order, offsets checked against the ``.rec``'s size.

    Keys are kept as text (MXNet's are usually integers); offsets must be distinct, inside the
    ``.rec`` and multiples of 4. The lines are sorted by offset, the order the records lie in.
    """
    size = os.stat(idx_path).st_size
    limit = _IDX_LINE_MAX * (max_records if max_records is not None else max(rec_size // 8, 1))
    if size > limit:
        raise DatasetError(f"{idx_path}: {size} bytes is more than an index of this .rec can hold")
    with open(idx_path, "rb") as fh:
        text = fh.read(size + 1)
    lines = text.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final newline
    keys, offsets = [], []
    for n, line in enumerate(lines):
        fields = line.split(b"\t")
        if len(fields) != 2 or not fields[1].isdigit() or not fields[0] or len(line) > _IDX_LINE_MAX:
            raise DatasetError(f"{idx_path}: line {n + 1} is not 'key<TAB>offset'")
        keys.append(fields[0].decode("ascii", "replace"))
        offsets.append(int(fields[1]))
    if max_records is not None and len(keys) != max_records:
        raise DatasetError(f"{idx_path}: lists {len(keys)} records, the manifest says {max_records}")
    arr = np.asarray(offsets, dtype=np.int64)
    order = np.argsort(arr, kind="stable")
    arr, keys = arr[order], [keys[i] for i in order.tolist()]
    if len(arr) and (arr[-1] >= rec_size or np.any(np.diff(arr) <= 0) or np.any(arr % 4)):
        raise DatasetError(f"{idx_path}: offsets repeat, are not 4-byte aligned or lie past the end of the .rec")
    return keys, arr


def scan_offsets(fd: int, size: int, where: object) -> tuple[np.ndarray, np.ndarray, str | None]:
    """(starts, ends) of the records of a ``.rec`` without an index (a walk over the part headers alone),
    and why the walk stopped early (None: it reached the end): the complete records before that stand.
    """
    starts, ends, pos, start, in_record = [], [], 0, 0, False
    problem = None
    while pos < size:
        head = os.pread(fd, 8, pos)
        if len(head) < 8:
            problem = f"{where}: ends inside a part header at byte {pos}"
            break
        magic, lrec = struct.unpack("<II", head)
        if magic != MAGIC:
            problem = f"{where}: bad RecordIO magic {magic:#010x} at byte {pos}"
            break
        cflag, length = lrec >> 29, lrec & MAX_LENGTH
        if not in_record:
            start = pos
        in_record = cflag in (1, 2)
        pos += 8 + length + (_pad(length) if cflag in (0, 3) else 0)
        if not in_record and pos <= size:
            starts.append(start)
            ends.append(pos)
    if problem is None and (pos != size or in_record):
        problem = f"{where}: the record at byte {start} runs past the end of the file ({size} bytes)"
    return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64), problem


def record_spans(rec_path: Path, fd: int,
                 idx_path: Path | None) -> tuple[list[str], np.ndarray, np.ndarray, str | None]:
    """(keys, starts, ends, problem) of a ``.rec``'s records: from its ``.idx`` (PackerError when that is
    damaged), or a walk of the file (``problem``: why it stopped before the end; the records before stand).
    """
    size = os.fstat(fd).st_size
    if idx_path is not None:
        keys, offsets = read_index(idx_path, size)
        return keys, offsets, np.append(offsets[1:], size), None
    starts, ends, problem = scan_offsets(fd, size, rec_path)
    return [str(i) for i in range(len(starts))], starts, ends, problem


def peek_header(fd: int, start: int, end: int, where: object) -> tuple[float | tuple[float, ...], int, int]:
    """(label or labels, id, id2) of the record at [start, end) from its first bytes, not the whole record.

    A record split right inside its header (rare) is read whole. Every length is checked.
    """
    head = os.pread(fd, min(end - start, 8 + IR_SIZE), start)
    if len(head) >= 8 + IR_SIZE:
        magic, lrec = struct.unpack_from("<II", head)
        flag = struct.unpack_from("<I", head, 8)[0]
        first = lrec & MAX_LENGTH
        if magic == MAGIC and first >= IR_SIZE + 4 * flag and 8 + first <= end - start:
            if flag:
                head = os.pread(fd, 8 + IR_SIZE + 4 * flag, start)
            label, id_, id2, _ = unpack_header(memoryview(head)[8:], where)
            return label, id_, id2
    label, id_, id2, _ = unpack_header(decode_record(os.pread(fd, end - start, start), where), where)
    return label, id_, id2


@dataclass(frozen=True)
class RecordInfo:
    """One record of a ``.rec`` file, as ``list_records`` finds it."""

    key: str  # from the .idx; the record's number when there is none
    offset: int  # where the record starts in the .rec
    end: int  # where the next one starts (the record's bytes, padding included, are [offset, end))
    label: float | tuple[float, ...]
    id: int
    id2: int
    image_bytes: int  # the image file's length inside the record


def list_records(rec_path: str | os.PathLike, idx_path: str | os.PathLike | None = None) -> Iterator[RecordInfo]:
    """The records of any RecordIO file with their labels, in file order, each checked as ``Reader`` checks.

    With ``idx_path`` the records are those the index lists; without one the ``.rec`` is walked
    part header by part header. ``read_record(rec_path, info)`` gives a record's image bytes.
    """
    rec_path = Path(rec_path)
    with open(rec_path, "rb") as fh:
        keys, offsets, ends, problem = record_spans(rec_path, fh.fileno(), None if idx_path is None else Path(idx_path))
        if problem:
            raise DatasetError(problem)
        for key, start, end in zip(keys, offsets.tolist(), ends.tolist()):
            where = f"{rec_path}: record {key} at byte {start}"
            data = decode_record(os.pread(fh.fileno(), end - start, start), where)
            label, id_, id2, image = unpack_header(data, where)
            yield RecordInfo(key, start, end, label, id_, id2, len(image))


def read_record(rec_path: str | os.PathLike, info: RecordInfo) -> bytes:
    """The image bytes of a record ``list_records`` found."""
    with open(rec_path, "rb") as fh:
        buf = os.pread(fh.fileno(), info.end - info.offset, info.offset)
    where = f"{rec_path}: record {info.key}"
    return bytes(unpack_header(decode_record(buf, where), where)[3])


@dataclass
class _Open:
    fd: int
    offsets: np.ndarray  # N+1: record starts, then the .rec's size
    data: memoryview  # the .rec mapped read-only (empty for an empty file)


class Reader(ShardReader):
    """Reads one shard's records as views of the mapped ``.rec`` (no copy, unlike a ``pread``); the index is parsed and
    checked on first use in each process."""

    def __init__(self, directory: Path, shard: Shard, payload: str, access: str = "sequential") -> None:
        if len(shard.files) != 2:
            raise DatasetError(f"{directory}: a recordio shard has a .rec and an .idx, the manifest lists "
                               f"{len(shard.files)}")
        self.path = directory / shard.files[0].name
        self.idx_path = directory / shard.files[1].name
        self.num_bytes = shard.files[0].num_bytes
        self.num_samples = shard.num_samples
        self.access = access
        self._h: PerProcess[_Open] = PerProcess()

    def _open(self) -> _Open:
        fd = open_checked(self.path, self.num_bytes)  # the map below then covers every record the index may name
        with closed_on_error(fd):
            try:
                keys, offsets = read_index(self.idx_path, self.num_bytes, self.num_samples)
            except OSError as exc:
                raise DatasetError(f"{self.idx_path}: cannot read ({exc.strerror or exc})") from exc
            if keys != [str(i) for i in range(self.num_samples)] or (len(offsets) and offsets[0] != 0):
                raise DatasetError(f"{self.idx_path}: keys are not 0..{self.num_samples - 1} in record order "
                                   "from byte 0")
            if not len(offsets) and self.num_bytes:
                raise DatasetError(f"{self.path}: {self.num_bytes} bytes, but the index lists no records")
            data = memoryview(map_readonly(self.path, fd, self.access)) if self.num_bytes else memoryview(b"")
        return _Open(fd, np.append(offsets, self.num_bytes), data)

    def _get(self) -> _Open:
        """The open shard, its file seen to have kept the manifest's size (a truncated map would fault)."""
        h = self._h.get(self._open)
        check_size(h.fd, self.num_bytes, self.path)
        return h

    def __len__(self) -> int:
        return self.num_samples

    def _image(self, h: _Open, pos: int) -> memoryview:
        where = f"{self.path}: record {pos}"
        record = h.data[int(h.offsets[pos]) : int(h.offsets[pos + 1])]
        return unpack_header(decode_record(record, where), where)[3]

    def read(self, pos: int) -> memoryview:
        """The image bytes of record ``pos``: a read-only view of the mapped file (a copy for a record in parts)."""
        return self._image(self._get(), pos)

    def read_many(self, positions: Sequence[int]) -> list[memoryview]:
        """``read`` of each position, after one size check."""
        h = self._get()
        return [self._image(h, p) for p in positions]

    def read_copies(self, positions: Sequence[int], buf: Destinations = None) -> list[memoryview]:
        """Each record's image bytes read with ``pread`` (its headers first, a small read; a record in parts whole),
        never from the map (``ShardReader.read_copies``)."""
        h = self._get()
        starts, ends = [], []
        whole: dict[int, memoryview] = {}  # place -> image of a record read whole (in parts, or damaged)
        for k, p in enumerate(positions):
            a, b = int(h.offsets[p]), int(h.offsets[p + 1])
            bounds = image_bounds(os.pread(h.fd, min(HEAD_BYTES, b - a), a), b - a)
            if bounds is None:
                record = os.pread(h.fd, b - a, a)
                if len(record) != b - a:  # the file ends sooner: cut short since it was checked
                    check_size(h.fd, self.num_bytes, self.path)
                where = f"{self.path}: record {p}"
                whole[k] = unpack_header(decode_record(record, where), where)[3]
                bounds = (0, 0)
            starts.append(a + bounds[0])
            ends.append(a + bounds[1])
        images = pread_ranges(h.fd, starts, ends, buf, self.path, self.num_bytes,
                              mapped=(np.frombuffer(h.data, np.uint8), 0) if len(h.data) else None)
        return [whole[k] if k in whole else image.data for k, image in enumerate(images)]

    def file_spans(self, positions: Sequence[int]) -> list[list[Span]]:
        """Per position, its record's bytes in the .rec (see packer.read.readahead)."""
        h = self._h.get(self._open)
        path = str(self.path)
        return [[(path, int(h.offsets[p]), int(h.offsets[p + 1]))] for p in positions]

    def close(self) -> None:
        """Forget this process's file; views handed out keep the map alive."""
        self._h.close(lambda h: os.close(h.fd))
        super().close()


FORMAT = Format(
    name="recordio", dataset_class="RecordIODataset", payloads=frozenset({"encoded"}), Writer=Writer, Reader=Reader,
    default_shard_bytes=None,
)
