"""RecordIO: what is specific to it (the shared round trip, fuzzing, verify: test_contract.py, test_fuzz.py).

The files are read here by a reader written from MXNet's description of the format alone (parse
the .idx, seek, check magic, lrecord, IRHeader, padding), and, where an interpreter with
``mxnet`` is at hand, by MXNet itself: it must read packer's records, and write the very same
bytes for the same records. ``mxnet`` 1.9 needs numpy < 2 (the test venv has numpy 2), so it is
looked for in this interpreter, then in ``$MXNET_PYTHON`` (e.g. a venv with ``pip install mxnet
"numpy<1.24"``); without either those two tests skip.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from support.fuzzing import _rewrite_checksums as recompute_checksums

from packer import PackerError, convert, open_dataset
from packer.formats import recordio
from packer.formats.base import PreparedSample
from packer.write.scan import scan_folder

MAGIC = 0xCED7230A


def parse_rec(rec: Path, idx: Path) -> list[tuple[int, int, float, int, int, bytes, int]]:
    """(key, offset, label, id, id2, image bytes, parts) per index line: MXNet's layout, read independently."""
    data = rec.read_bytes()
    out = []
    lines = idx.read_text().splitlines()
    for line in lines:
        key, offset = line.split("\t")
        pos, chunks, parts = int(offset), [], 0
        while True:
            magic, lrec = struct.unpack_from("<II", data, pos)
            assert magic == MAGIC
            cflag, length = lrec >> 29, lrec & ((1 << 29) - 1)
            assert cflag in ((0, 1) if parts == 0 else (2, 3))  # whole or first; then middle or last
            chunks.append(data[pos + 8 : pos + 8 + length])
            parts += 1
            pos += 8 + length
            if cflag in (0, 3):
                pad = -length % 4
                assert data[pos : pos + pad] == b"\0" * pad
                pos += pad
                break
        payload = struct.pack("<I", MAGIC).join(chunks)
        flag, label, id_, id2 = struct.unpack_from("<IfQQ", payload)
        assert flag == 0
        out.append((int(key), int(offset), label, id_, id2, payload[24:], parts))
    ends = [o for _, o, *_ in out[1:]] + [len(data)]
    assert all(e % 4 == 0 for e in ends)
    return out


@pytest.fixture(scope="module")
def packed(imagefolder, tmp_path_factory):
    out = tmp_path_factory.mktemp("rec") / "ds.recordio"
    convert(imagefolder, out, to="recordio", shard_bytes=6_000, workers=1, progress=False)
    return out


def test_files_are_mxnet_records_of_the_source_files(packed, imagefolder):
    ds = open_dataset(packed)
    scan = scan_folder(imagefolder)
    labels = dict(zip(scan.rel_paths, scan.labels.tolist()))
    seen = 0
    for k, shard in enumerate(ds.manifest.shards):
        rec, idx = (packed / f.name for f in shard.files)
        assert (rec.name, idx.name) == (f"shard-{k:05d}.rec", f"shard-{k:05d}.idx")
        records = parse_rec(rec, idx)
        assert [r[0] for r in records] == list(range(shard.num_samples)) and records[0][1] == 0
        for key, _offset, label, id_, id2, image, _parts in records:
            rel = ds.index.rel_path(seen + key)
            assert image == (imagefolder / rel).read_bytes()
            assert label == float(labels[rel]) and id_ == key and id2 == 0
        seen += shard.num_samples
    assert seen == len(ds) == len(scan)


def test_flat_folder_labels_are_minus_one(flatfolder, tmp_path):
    convert(flatfolder, tmp_path / "f.recordio", workers=0, progress=False, to="recordio")
    records = parse_rec(tmp_path / "f.recordio/shard-00000.rec", tmp_path / "f.recordio/shard-00000.idx")
    assert {r[2] for r in records} == {-1.0} and open_dataset(tmp_path / "f.recordio").targets == [-1] * len(records)


def test_raw_payloads_are_refused(imagefolder, tmp_path):
    with pytest.raises(PackerError, match="stores only encoded"):
        convert(imagefolder, tmp_path / "r.recordio", to="recordio", payload="raw", progress=False)


def sample(k: int, payload: bytes, label: int = 1) -> PreparedSample:
    return PreparedSample(k, f"x/{k}.jpg", label, payload, 1, 1)


# Payloads holding the magic where dmlc's writer splits a record (4-byte aligned in the record's data,
# which starts with the 24-byte IRHeader), unaligned where it must not, at the very start and end.
M = struct.pack("<I", MAGIC)
TRICKY = [b"abcd" + M + b"efgh", M + b"xyz", b"12" + M + b"34567", b"abcd" + M, M + M + b"q" * 9, b"z" * 5, b"w"]


def write_shard(tmp_path: Path, payloads: list[bytes]) -> Path:
    writer = recordio.Writer(tmp_path, 0, len(payloads), "encoded", {})
    for k, p in enumerate(payloads):
        writer.add(sample(k, p))
    names, _ = writer.close()
    assert names == ["shard-00000.rec", "shard-00000.idx"]
    return tmp_path


def test_records_holding_the_magic_are_split_as_dmlc_does_and_read_back_whole(tmp_path):
    write_shard(tmp_path, TRICKY)
    rec, idx = tmp_path / "shard-00000.rec", tmp_path / "shard-00000.idx"
    records = parse_rec(rec, idx)
    assert [r[5] for r in records] == TRICKY
    assert [r[6] for r in records] == [2, 2, 1, 2, 3, 1, 1]  # aligned magics split; "12"+M is unaligned
    from packer.layout.manifest import FileInfo, Shard

    shard = Shard(len(TRICKY), [FileInfo(rec.name, rec.stat().st_size, "0" * 64),
                                FileInfo(idx.name, idx.stat().st_size, "0" * 64)])
    reader = recordio.Reader(tmp_path, shard, "encoded")
    assert [bytes(reader.read(i)) for i in range(len(TRICKY))] == TRICKY
    assert [bytes(b) for b in reader.read_many([3, 4, 5, 0])] == [TRICKY[i] for i in (3, 4, 5, 0)]
    infos = list(recordio.list_records(rec, idx))
    assert infos == list(recordio.list_records(rec))  # the index and a walk of the file agree
    assert [recordio.read_record(rec, i) for i in infos] == TRICKY and {i.label for i in infos} == {1.0}


def test_records_are_views_of_the_mapped_rec_not_copies(packed):
    """Whole records are read without a copy: each payload is a view into its shard's one map of the .rec."""
    import mmap

    ds = open_dataset(packed)
    payloads = ds.read_payloads(list(range(len(ds))))
    assert all(isinstance(p, memoryview) and isinstance(p.obj, mmap.mmap) for p in payloads)
    assert len({id(p.obj) for p in payloads}) == len(ds.manifest.shards)
    rec = b"".join((packed / s.files[0].name).read_bytes() for s in ds.manifest.shards)
    assert all(bytes(p) in rec for p in payloads[:5])


def test_file_spans_hold_each_record(packed):
    ds = open_dataset(packed)
    for i in range(len(ds)):
        shard, pos = ds.locate(i)
        [[(path, a, b)]] = ds.store.readers[shard].file_spans([pos])
        with open(path, "rb") as fh:
            fh.seek(a)
            record = fh.read(b - a)
        assert record[:4] == M and bytes(ds.read_payload(i)) in record and (b - a) % 4 == 0


# ------------------------------------------------------------------ crafted files


@pytest.fixture
def copy(packed, tmp_path):
    shutil.copytree(packed, tmp_path / "ds")
    return tmp_path / "ds"


def read_all(path: Path) -> None:
    ds = open_dataset(path)
    for i in range(len(ds)):
        ds.read_payload(i)


def edit(path: Path, fn) -> None:
    path.write_bytes(fn(path.read_bytes()))
    recompute_checksums(path.parent)


@pytest.mark.parametrize("change,match", [
    (lambda t: t.replace(b"\t0\n", b"\t8\n", 1), "keys are not|past the end|fills|record"),
    (lambda t: t.replace(b"1\t", b"7\t", 1), "keys are not"),
    (lambda t: t + b"99\t4000000000\n", "lists|past the end"),
    (lambda t: b"0\t0\n" + t, "repeat|lists"),
    (lambda t: t.replace(b"\t", b" "), "not 'key<TAB>offset'"),
    (lambda t: t[: len(t) // 2], "lists|not 'key"),
], ids=["first-offset", "key", "extra-line", "repeated", "separator", "truncated"])
def test_crafted_index_is_refused(copy, change, match):
    edit(copy / "shard-00000.idx", change)
    with pytest.raises(PackerError, match=match):
        read_all(copy)


def test_a_record_claiming_a_huge_length_is_refused_before_reading(copy):
    def huge(data: bytes) -> bytes:
        return data[:4] + struct.pack("<I", (1 << 29) - 1) + data[8:]

    edit(copy / "shard-00000.rec", huge)
    with pytest.raises(PackerError, match="past the record's end"):
        read_all(copy)


def test_bad_magic_and_flag_sequence_are_refused(copy):
    edit(copy / "shard-00000.rec", lambda d: b"\0\0\0\0" + d[4:])
    with pytest.raises(PackerError, match="bad RecordIO magic"):
        read_all(copy)
    edit(copy / "shard-00000.rec",
         lambda d: M + struct.pack("<I", 2 << 29 | (struct.unpack_from("<I", d, 4)[0] & ((1 << 29) - 1))) + d[8:])
    with pytest.raises(PackerError, match="out of sequence"):
        read_all(copy)


def test_a_truncated_rec_is_refused(copy):
    edit(copy / "shard-00000.rec", lambda d: d[:-8])
    with pytest.raises(PackerError, match="record|truncated"):
        read_all(copy)


def test_list_records_walks_a_rec_without_index_and_refuses_garbage(packed, tmp_path):
    rec = packed / "shard-00000.rec"
    assert [i.offset for i in recordio.list_records(rec)] == [i.offset for i in recordio.list_records(
        rec, packed / "shard-00000.idx")]
    junk = tmp_path / "junk.rec"
    junk.write_bytes(rec.read_bytes()[:-3])
    with pytest.raises(PackerError):
        list(recordio.list_records(junk))


# ------------------------------------------------------------------ MXNet itself

MXNET_SCRIPT = r"""
import json, sys
from mxnet import recordio
cmd, rec, idx = sys.argv[1:4]
if cmd == "read":
    r = recordio.MXIndexedRecordIO(idx, rec, "r")
    out = []
    for key in r.keys:
        header, image = recordio.unpack(r.read_idx(key))
        out.append([key, float(header.label), int(header.id), int(header.id2), image.hex()])
    r.close()
    print(json.dumps(out))
else:
    w = recordio.MXIndexedRecordIO(idx, rec, "w")
    for key, (label, payload) in enumerate(json.load(sys.stdin)):
        w.write_idx(key, recordio.pack(recordio.IRHeader(0, label, key, 0), bytes.fromhex(payload)))
    w.close()
"""


def mxnet_python() -> str:
    for python in (sys.executable, os.environ.get("MXNET_PYTHON")):
        if python and subprocess.run([python, "-c", "import mxnet.recordio"], capture_output=True).returncode == 0:
            return python
    pytest.skip("mxnet is not importable here nor in $MXNET_PYTHON (mxnet 1.9 needs numpy < 2)")


def run_mxnet(python: str, tmp_path: Path, *args: str, stdin: str = "") -> str:
    script = tmp_path / "mx.py"
    script.write_text(MXNET_SCRIPT)
    res = subprocess.run([python, str(script), *args], input=stdin, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_mxnet_reads_packers_records(packed, imagefolder, tmp_path):
    python = mxnet_python()
    ds = open_dataset(packed)
    seen = 0
    for shard in ds.manifest.shards:
        rec, idx = (str(packed / f.name) for f in shard.files)
        records = json.loads(run_mxnet(python, tmp_path, "read", rec, idx))
        assert [r[0] for r in records] == list(range(shard.num_samples))
        for key, label, id_, id2, image in records:
            i = seen + key
            assert bytes.fromhex(image) == (imagefolder / ds.index.rel_path(i)).read_bytes()
            assert (label, id_, id2) == (float(ds.targets[i]), key, 0)
        seen += shard.num_samples


def test_mxnet_writes_the_same_bytes(imagefolder, tmp_path):
    python = mxnet_python()
    payloads = TRICKY + [p.read_bytes() for p in sorted(imagefolder.rglob("*.jpg"))[:4]]
    write_shard(tmp_path, payloads)
    stdin = json.dumps([[1, p.hex()] for p in payloads])
    run_mxnet(python, tmp_path, "write", str(tmp_path / "mx.rec"), str(tmp_path / "mx.idx"), stdin=stdin)
    assert (tmp_path / "mx.rec").read_bytes() == (tmp_path / "shard-00000.rec").read_bytes()
    assert (tmp_path / "mx.idx").read_bytes() == (tmp_path / "shard-00000.idx").read_bytes()
