"""N5: what is specific to it (the shared round trip, fuzzing, verify: test_contract.py, test_fuzz.py).

Every array packer writes is read back with tensorstore's ``n5`` driver (a test-only dependency,
the ``test`` extra), in N5's own dimension order, and must equal what packer reads; blocks that
tensorstore writes (full-size edge blocks) must read back too. Crafted blocks and attributes
(gzip bombs, lying headers, huge block sizes) give PackerError without the allocation.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from support.fds import open_files_under
from support.fuzzing import _rewrite_checksums as recompute_checksums

from packer import PackerError, convert, open_dataset
from packer.cli import main as cli_main
from packer.formats.n5 import blocks as n5blocks
from packer.formats.n5 import reader as n5read

ts = pytest.importorskip("tensorstore")

CASES = {  # name -> convert options; small --n5-block sizes make samples span blocks (24x32: 2 images a block)
    "encoded": {"n5_block": 3000},
    "encoded-1MiB": {},
    "raw": {"payload": "raw", "n5_block": "5kB"},
    "raw-24x32": {"payload": "raw", "resize": "24x32", "n5_block": 5000},
    "raw-24x32-gzip": {"payload": "raw", "resize": "24x32", "compression": "gzip", "n5_block": 5000},
    "raw-gzip": {"payload": "raw", "compression": "gzip"},
}


@pytest.fixture(scope="module")
def packed(imagefolder, tmp_path_factory):
    root = tmp_path_factory.mktemp("n5")
    out = {}
    for name, opts in CASES.items():
        out[name] = root / f"{name}.n5"
        convert(imagefolder, out[name], to="n5", shard_bytes=20_000, workers=1, progress=False, order="source",
                **opts)  # stored in ImageFolder's order: tensorstore's arrays line up with ds[i]
    return out


def ts_read(container: Path, name: str) -> np.ndarray:
    """A dataset as tensorstore reads it, turned from N5's dimension order to numpy's (reversed)."""
    spec = {"driver": "n5", "kvstore": {"driver": "file", "path": str(container)}, "path": name}
    arr = ts.open(spec, read=True).result().read().result()
    return np.ascontiguousarray(arr.transpose(tuple(reversed(range(arr.ndim)))))


@pytest.mark.parametrize("case", list(CASES))
def test_tensorstore_reads_every_array_packer_wrote(packed, case):
    path = packed[case]
    ds = open_dataset(path, image="numpy")
    start = 0
    for k, shard in enumerate(ds.manifest.shards):
        container = path / f"shard-{k:05d}.n5"
        assert json.loads((container / "attributes.json").read_text())["n5"] == "2.0.0"
        n = shard.num_samples
        images = ts_read(container, "images")
        labels = ts_read(container, "labels")
        assert labels.dtype == np.int64 and labels.tolist() == ds.targets[start : start + n]
        if "24x32" in case:
            attrs = json.loads((container / "images/attributes.json").read_text())
            assert attrs["dimensions"] == [3, 32, 24, n] and attrs["blockSize"] == [3, 32, 24, 2]
            assert images.shape == (n, 24, 32, 3)
            got = list(images)
        else:
            offsets = ts_read(container, "offsets")
            assert offsets[0] == 0 and offsets[-1] == len(images)
            got = [images[offsets[i] : offsets[i + 1]] for i in range(n)]
            if case.startswith("raw"):
                shapes = ts_read(container, "shapes")
                got = [g.reshape(s) for g, s in zip(got, shapes)]
        for i, g in enumerate(got):
            want = ds.read_payload(start + i)
            assert np.array_equal(g, np.frombuffer(want, np.uint8) if case.startswith("encoded") else want)
        start += n
    assert start == len(ds)


def test_samples_span_blocks_where_the_block_size_says(packed):
    for case in ("encoded", "raw", "raw-24x32", "raw-24x32-gzip"):
        ds = open_dataset(packed[case])
        spans = [ds.store.readers[s].file_spans([p])[0] for s, p in map(ds.locate, range(len(ds)))]
        files = {path for sample in spans for path, *_ in sample}
        assert len(files) > len(ds.manifest.shards), case  # several blocks a shard
        if not case.startswith("raw-24x32"):
            assert any(len(sample) > 1 for sample in spans), case  # and samples across blocks
    assert open_dataset(packed["raw"]).manifest.options["n5_block"] == "5kB"


def test_gzip_blocks_are_java_default_gzip_and_deterministic(packed, imagefolder, tmp_path):
    container = packed["raw-24x32-gzip"] / "shard-00000.n5"
    attrs = json.loads((container / "images/attributes.json").read_text())
    assert attrs["compression"] == {"type": "gzip", "level": -1, "useZlib": False}
    block = (container / "images/0/0/0/0").read_bytes()
    mode, ndim = struct.unpack_from(">HH", block)
    assert (mode, ndim) == (0, 4) and block[4 + 16 : 4 + 18] == b"\x1f\x8b"  # gzip magic after the header
    again = tmp_path / "again.n5"
    convert(imagefolder, again, to="n5", shard_bytes=20_000, workers=2, progress=False, order="source",
            **CASES["raw-24x32-gzip"])
    for p in sorted(packed["raw-24x32-gzip"].rglob("*")):
        rel = p.relative_to(packed["raw-24x32-gzip"])
        if p.is_file() and rel.name != "manifest.json":
            assert (again / rel).read_bytes() == p.read_bytes(), rel


@pytest.fixture
def copy(packed, tmp_path):
    def make(case: str) -> Path:
        shutil.copytree(packed[case], tmp_path / case)
        return tmp_path / case
    return make


def read_all(path: Path) -> list:
    ds = open_dataset(path, image="numpy")
    return [ds.read_payload(i) for i in range(len(ds))]


@pytest.mark.parametrize("case", ["raw-24x32-gzip", "raw-24x32", "encoded"])
def test_blocks_tensorstore_writes_read_back(packed, copy, case):
    """tensorstore rewrites the images dataset (its edge blocks full-size, its own gzip): same samples."""
    path = copy(case)
    expected = [np.asarray(p).copy() for p in read_all(packed[case])]
    for container in sorted(path.glob("shard-*.n5")):
        data = ts_read(container, "images")
        spec = {"driver": "n5", "kvstore": {"driver": "file", "path": str(container)}, "path": "images"}
        store = ts.open(spec, read=True, write=True).result()
        store[...] = data.transpose(tuple(reversed(range(data.ndim))))
    recompute_checksums(path)
    got = read_all(path)
    assert all(np.array_equal(np.asarray(g), e) for g, e in zip(got, expected)) and len(got) == len(expected)


def put_block(container: Path, rel: str, dims: list[int], body: bytes, gzip: bool) -> None:
    header = struct.pack(f">HH{len(dims)}I", 0, len(dims), *dims)
    if gzip:
        comp = zlib.compressobj(-1, zlib.DEFLATED, 31)
        body = comp.compress(body) + comp.flush()
    (container / rel).write_bytes(header + body)
    recompute_checksums(container.parent)


def test_a_gzip_bomb_stops_at_the_block_size(copy):
    path = copy("raw-24x32-gzip")
    container = path / "shard-00000.n5"
    dims = list(struct.unpack_from(">4I", (container / "images/0/0/0/0").read_bytes(), 4))
    put_block(container, "images/0/0/0/0", dims, bytes(400 << 20), gzip=True)  # 400 MB of zeros: ~400 KB
    code = (
        "import resource, sys\n"
        "from packer import open_dataset, PackerError\n"
        "ds = open_dataset(sys.argv[1])\n"
        "vm = int(next(l for l in open('/proc/self/status') if l.startswith('VmSize')).split()[1]) * 1024\n"
        "resource.setrlimit(resource.RLIMIT_AS, (vm + (150 << 20), resource.RLIM_INFINITY))\n"
        "try:\n    [ds.read_payload(i) for i in range(len(ds))]\n"
        "except PackerError as exc:\n    print('REFUSED', exc)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert "REFUSED" in res.stdout and "inflates to more than" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("what,match", [
    ("dims", "N5 block of sizes"),
    ("mode", "header mode"),
    ("longer", "holds .* bytes of data|N5 block of"),
    ("shorter", "holds .* bytes of data|N5 block of"),
])
def test_block_headers_are_checked_against_the_attributes(copy, what, match):
    path = copy("raw")  # uncompressed blob: offsets/0 is read whole, images blocks by range
    container = path / "shard-00000.n5"
    block = (container / "offsets/0").read_bytes()
    (n,) = struct.unpack_from(">I", block, 4)
    if what == "dims":
        put_block(container, "offsets/0", [n + 1], block[8:] + bytes(8), gzip=False)
    elif what == "mode":
        (container / "offsets/0").write_bytes(b"\x00\x01" + block[2:])
        recompute_checksums(path)
    else:
        put_block(container, "offsets/0", [n], block[8:] + bytes(8) if what == "longer" else block[8:-8], gzip=False)
    with pytest.raises(PackerError, match=match):
        read_all(path)


def test_images_block_with_wrong_length_is_refused(copy):
    path = copy("raw-24x32")
    block = path / "shard-00000.n5/images/0/0/0/0"
    block.write_bytes(block.read_bytes() + b"\0" * 3)
    recompute_checksums(path)
    ds = open_dataset(path, image="numpy")
    with pytest.raises(PackerError, match="N5 block of .* bytes"):
        ds.read_payload(0)


@pytest.mark.parametrize("edit,match", [
    (lambda a: a.update(blockSize=[3, 32, 24, 1 << 30]), "blocks of"),
    (lambda a: a.update(dimensions=[3, 32, 24, 10**12]), "blocks, the manifest lists|shape"),
    (lambda a: a.update(dataType="float32"), "dataType"),
    (lambda a: a.update(compression={"type": "blosc"}), "compression"),
    (lambda a: a.update(blockSize=[3, 16, 24, 2]), "split more than"),
    (lambda a: a.update(dimensions="x"), "not valid"),
], ids=["huge-block", "huge-dims", "dtype", "codec", "split", "garbage"])
def test_crafted_attributes_are_refused(copy, edit, match):
    path = copy("raw-24x32")
    attrs_path = path / "shard-00000.n5/images/attributes.json"
    attrs = json.loads(attrs_path.read_text())
    edit(attrs)
    attrs_path.write_text(json.dumps(attrs))
    recompute_checksums(path)
    with pytest.raises(PackerError, match=match):
        read_all(path)


@pytest.mark.parametrize("case", ["encoded", "raw", "raw-24x32"])
def test_file_spans_hold_each_sample(packed, case):
    """Each sample's ranges, read and joined, are its bytes (across blocks too); asked a batch at once, in any order
    with repeats, each sample gets the ranges it gets alone; ``cached`` (ranges per block file at once) answers as
    the default from ``file_spans`` does."""
    from packer.formats.base import ShardReader

    ds = open_dataset(packed[case], image="numpy")
    crossing = 0
    for i in range(len(ds)):
        shard, pos = ds.locate(i)
        spans = ds.store.readers[shard].file_spans([pos])[0]
        crossing += len(spans) > 1
        got = b""
        for path, a, b in spans:
            with open(path, "rb") as fh:
                fh.seek(a)
                got += fh.read(b - a)
        assert got == np.asarray(ds.read_payload(i)).tobytes()
    assert (crossing > 0) == (case != "raw-24x32")  # there: two whole images a block
    reader = ds.store.readers[0]
    positions = np.random.default_rng(0).integers(0, len(reader), 3 * len(reader)).tolist()
    assert reader.file_spans(positions) == [reader.file_spans([p])[0] for p in positions]
    assert reader.cached(positions).tolist() == ShardReader.cached(reader, positions).tolist()


@pytest.mark.parametrize("case", ["encoded", "raw", "raw-24x32"])
def test_uncompressed_samples_are_views_of_the_mapped_blocks(packed, case):
    """A sample inside one block is a read-only view of that block file's map; one across blocks is joined."""
    ds = open_dataset(packed[case], image="numpy")
    joined = 0
    for reader in ds.store.readers:
        positions = list(range(len(reader)))
        got = reader.read_many(positions)
        h = reader._h.get(reader._open)
        for payload, spans in zip(got, reader.file_spans(positions)):
            arr = np.asarray(payload)
            assert arr.tobytes() == b"".join(Path(p).read_bytes()[a:b] for p, a, b in spans)
            mapped = [entry[1] for entry in h.maps.values()]
            if len(spans) == 1:
                assert not arr.flags.writeable and any(np.shares_memory(arr, m) for m in mapped)
            else:
                joined += 1
                assert not arr.flags.writeable and not any(np.shares_memory(arr, m) for m in mapped)
    assert joined > 0 or case == "raw-24x32"  # whole images per block in the fixed layout


def test_samples_kept_hold_no_descriptors_beyond_the_lru(packed, monkeypatch):
    """Views outlive their block's place in the LRU: the maps hold no descriptor, so keeping every sample of a
    many-block dataset costs only the LRU's descriptors (a Python mmap each would run out of them)."""
    monkeypatch.setattr(n5read, "_MAPPED_BLOCKS", 2)
    ds = open_dataset(packed["raw"], image="numpy")
    assert sum(len(r._h.get(r._open).blocks) for r in ds.store.readers) > 8
    before = len(open_files_under(packed["raw"]))  # the dataset's files only: other descriptors come and go
    kept = [ds[i][0] for i in range(len(ds))]
    assert len(open_files_under(packed["raw"])) - before <= 2 * len(ds.store.readers)
    ds.close()
    assert len(open_files_under(packed["raw"])) <= before
    fresh = open_dataset(packed["raw"], image="numpy")
    assert all(np.array_equal(a, fresh[i][0]) for i, a in enumerate(kept))  # still readable after close


@pytest.mark.parametrize("case", ["raw", "raw-24x32-gzip"])
def test_threads_share_a_reader_and_its_lru(packed, monkeypatch, case):
    """Several threads reading one dataset while blocks leave and re-enter a small LRU get every sample right."""
    monkeypatch.setattr(n5read, "_MAPPED_BLOCKS", 2)
    monkeypatch.setattr(n5read, "_DECODED_BLOCKS", 1)
    expected = [np.array(x) for x, _ in open_dataset(packed[case], image="numpy")]
    ds = open_dataset(packed[case], image="numpy")
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, inside the LRU's bookkeeping too

    def work(seed: int) -> int:
        rng, wrong = np.random.default_rng(seed), 0
        for _ in range(300):
            i = int(rng.integers(len(ds)))
            wrong += not np.array_equal(ds[i][0], expected[i])
        return wrong

    try:
        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(work, range(8))) == 0
    finally:
        sys.setswitchinterval(switch)


def test_copies_of_a_batch_over_more_blocks_than_the_lru_holds_come_from_their_own_blocks(packed, monkeypatch):
    """``read_copies`` (ThreadLoader's reads) of a batch that returns to a block after the LRU closed its descriptor:
    every sample from its own block file (a descriptor kept across the batch was read after its number had been
    reused by a later block's file: another block's bytes, silently)."""
    monkeypatch.setattr(n5read, "_MAPPED_BLOCKS", 2)
    ds = open_dataset(packed["raw-24x32"], image="numpy")  # two images a block
    reader = ds.store.readers[0]
    assert len(reader) >= 8
    positions = [0, 2, 4, 6, 1, 3]  # blocks 0, 1, 2, 3, then 0 and 1 again: out of the LRU of two by then
    expected = [np.array(x) for x in reader.read_many(positions)]
    reader.close()
    got = reader.read_copies(positions)
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
    ds.close()


def test_a_block_truncated_while_open_is_refused_without_leaking_its_descriptor(copy):
    root = copy("raw")
    ds = open_dataset(root, image="numpy")
    ds[0]
    block = next(p for p in sorted(root.rglob("images/*")) if p.is_file() and p.name == "0")
    assert open_files_under(block) == [str(block)]  # held by the LRU
    os.truncate(block, 20)
    with pytest.raises(PackerError, match="changed size"):  # the block as mapped
        ds[0]
    for _ in range(2):
        with pytest.raises(PackerError, match="N5 block of 12 bytes"):  # mapped afresh: its header disagrees
            ds[0]
    assert open_files_under(block) == []  # the block's descriptor went with its LRU entry


def test_the_cli_takes_compression_for_raw_only(imagefolder, tmp_path, capsys):
    out = tmp_path / "c.n5"
    assert cli_main(["convert", str(imagefolder), "--to", "n5", "--payload", "raw", "--resize", "24x32",
                     "--compression", "gzip", "-o", str(out), "-q"]) == 0
    assert open_dataset(out).manifest.shards[0].facts["compression"] == "gzip"
    argv = ["convert", str(imagefolder), "--to", "n5", "--compression", "gzip", "-o", str(tmp_path / "e")]
    assert cli_main(argv) == 2
    assert "raw payloads only" in capsys.readouterr().err
    assert cli_main(["convert", str(imagefolder), "--to", "n5", "--payload", "raw", "--compression", "lzf",
                     "-o", str(tmp_path / "l")]) == 2
    assert "offers gzip" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # out of range: argparse's usage error, before any work
        cli_main(["convert", str(imagefolder), "--to", "n5", "--n5-block", "0", "-o", str(tmp_path / "z")])
    assert exit_.value.code == 2 and "argument --n5-block" in capsys.readouterr().err
    assert not (tmp_path / "z").exists()


def test_array_blocks_round_trip_through_the_module(tmp_path):
    """The module's own writer and block checks on an int64 array of several blocks."""
    arr = n5blocks.Array((10, 3), 4, "int64")
    data = np.arange(30, dtype=np.int64).reshape(10, 3)
    names = n5blocks.write_dataset(tmp_path, "x", arr, data)
    assert names == ["x/attributes.json", "x/0/0", "x/0/1", "x/0/2"]
    assert np.array_equal(ts_read(tmp_path, "x"), data)
    last = (tmp_path / "x/0/2").read_bytes()
    assert n5blocks.check_block_header(last, arr, 2, "x") == 2 * 3  # the edge block is cut to 2 rows


@pytest.mark.parametrize("case", ["raw-24x32-gzip", "raw-gzip", "encoded"])
def test_fuzzed_gzip_and_multi_block_layouts_read_or_raise_packer_error(packed, case, tmp_path, request):
    """test_fuzz.py's harness on the layouts the contract cases leave out (gzip, samples across blocks)."""
    from support.fuzzing import run_cases

    count = request.config.getoption("--fuzz-cases")
    results = run_cases(packed[case], tmp_path, list(range(count)))
    crashes = [f"seed {r['seed']} {r.get('desc')}: {r['crash'][:300]}" for r in results if r.get("crash")]
    assert not crashes, "\n".join(crashes)
    assert not [r for r in results if r.get("outside_reads")]
    assert not [r for r in results if r.get("wrong") and not r["crafted"] and r["verify_ok"] is not False]


def test_an_inflater_goes_only_as_far_as_asked_and_checks_the_end():
    arr = n5blocks.Array((8,), 8, "uint8", "gzip")
    comp = zlib.compressobj(-1, zlib.DEFLATED, 31)
    good = comp.compress(bytes(range(8))) + comp.flush()
    inflater = n5blocks.Inflater(arr, good, 8, "b")
    assert bytes(inflater.upto(3)[:3]) == bytes(range(3)) and len(inflater.out) < 8 + (1 << 16)
    assert bytes(inflater.upto(8)) == bytes(range(8)) and inflater.d.eof
    with pytest.raises(PackerError, match="inflates to other than"):
        n5blocks.Inflater(arr, good[:-12], 8, "b").upto(8)  # stream cut short
    with pytest.raises(PackerError, match="inflates to other than"):
        n5blocks.Inflater(arr, good, 9, "b").upto(9)  # ends before the block's size
    comp = zlib.compressobj(-1, zlib.DEFLATED, 31)
    big, more = n5blocks.Array((1 << 20,), 1 << 20, "uint8", "gzip"), comp.compress(bytes((1 << 20) + 1)) + comp.flush()
    inflater = n5blocks.Inflater(big, more, 1 << 20, "b")
    assert len(inflater.upto(10)) == 1 << 16  # a prefix reads, in 64 KiB steps ...
    with pytest.raises(PackerError, match="inflates to more than"):
        inflater.upto(1 << 20)  # ... and the end is checked once reached
    with pytest.raises(PackerError, match="damaged gzip"):
        n5blocks.Inflater(arr, b"\x1f\x8b" + bytes(30), 8, "b").upto(8)
