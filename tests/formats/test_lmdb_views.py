"""LMDB values as views of the reader's own map (packer.formats.lmdb.values): the same bytes py-lmdb returns,
spans files that disagree with the shard refused in one line, fork and spawn workers, shards without spans."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest
from support.fuzzing import _rewrite_checksums as recompute_checksums
from support.imagesets import make_imagefolder
from support.spawned import Fetch, batches_of, probe_for
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, default_convert

from packer import PackerError, Writer, convert, open_dataset
from packer.formats.lmdb.pages import Tree
from packer.formats.lmdb.values import check_against_btree, key, spans_from_btree

CASES = {"encoded": {}, "raw": {"payload": "raw"}, "fixed": {"payload": "raw", "resize": "16x12"}}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return make_bases(tmp_path_factory.mktemp("lmdbviews"))


def make_bases(root: Path) -> Path:
    src = make_imagefolder(root / "src", classes=3, per_class=8, size=(24, 32))
    for name, options in CASES.items():  # small shards: several per dataset
        convert(src, root / name, to="lmdb", shard_bytes=4_000, workers=0, progress=False, **options)
    return root


@pytest.fixture
def copy(bases, tmp_path):
    def make(name: str) -> Path:
        shutil.copytree(bases / name, tmp_path / name)
        return tmp_path / name
    return make


def lmdb_values(path: Path) -> list[bytes]:
    """Every value of every shard, in storage order, as py-lmdb returns them (its environments closed after)."""
    manifest = json.loads((path / "manifest.json").read_text())
    out = []
    for shard in manifest["shards"]:
        env = lmdb.open(str(path / shard["files"][0]["name"]), subdir=False, readonly=True, lock=False)
        with env.begin() as txn:
            out += [txn.get(b"%010d" % i) for i in range(shard["num_samples"])]
        env.close()
    return out


def read_first(path: Path) -> None:
    open_dataset(path).payloads_at([0])  # the sample stored first: shard 0


@pytest.mark.parametrize("name", list(CASES))
def test_views_equal_py_lmdb_values(bases, name):
    expected = lmdb_values(bases / name)
    ds = open_dataset(bases / name)
    assert len(ds.manifest.shards) > 2
    n = len(ds)
    got = ds.payloads_at(np.arange(n))
    assert all(isinstance(p, memoryview) and p.readonly for p in got)
    assert [bytes(p) for p in got] == expected
    assert [bytes(ds.payload_at(i)) for i in range(n)] == expected
    shuffled = np.random.default_rng(0).permutation(n)
    assert [bytes(p) for p in ds.payloads_at(shuffled)] == [expected[i] for i in shuffled]


@pytest.mark.parametrize("first", ["py-lmdb", "packer"])
def test_a_py_lmdb_environment_open_on_a_shard_in_this_process(bases, first):
    """A user's own lmdb.Environment on a shard, opened before or after the dataset reads it: both read (py-lmdb
    refuses to open one file twice in a process, and packer once opened every shard with it)."""
    path = bases / "encoded"
    expected = lmdb_values(path)
    shard = str(path / "shard-00000.lmdb")
    ds = open_dataset(path)
    if first == "packer":
        assert bytes(ds.payload_at(0)) == expected[0]
    env = lmdb.open(shard, subdir=False, readonly=True, lock=False)
    try:
        assert [bytes(p) for p in ds.payloads_at(np.arange(len(ds)))] == expected
        assert bytes(open_dataset(path)[0][0].tobytes()) and ds.read_payload(0) is not None
        with env.begin() as txn:
            assert txn.get(b"%010d" % 0) == expected[0]
    finally:
        env.close()


def test_fixed_shape_batches_copy_the_stored_pixels(bases):
    ds = open_dataset(bases / "fixed", image="tensor")
    expected = [np.frombuffer(v, np.uint8).reshape(16, 12, 3) for v in lmdb_values(bases / "fixed")]
    assert ds.fixed_shape == (16, 12, 3) and ds.manifest.shards[0].facts["shape"] == [16, 12, 3]
    for order in (list(range(len(ds))), np.random.default_rng(1).permutation(len(ds)).tolist(), [5, 5, 0]):
        images, labels = ds.get_batch(order)
        assert np.array_equal(images.numpy(), np.stack([expected[ds.position(i)] for i in order]))
        assert labels.tolist() == [ds.targets[i] for i in order]
    reader = ds.store.readers[0]
    out = np.zeros((3, 16, 12, 3), np.uint8)
    reader.read_into([2, 0, 1], out)  # any order
    assert all(np.array_equal(out[k], expected[p]) for k, p in enumerate([2, 0, 1]))
    with pytest.raises(PackerError, match="not 288 bytes long"):
        reader.read_into([0], np.zeros((1, 8, 12, 3), np.uint8))


@pytest.mark.parametrize("craft, message", [
    ("shifted", "spans disagree with the LMDB B-tree"),  # every value one byte early, sizes right
    ("swapped", "spans disagree with the LMDB B-tree"),  # first and last swapped (same sizes in the fixed case)
    ("overlap", "two values overlap"),
    ("past-end", "spans do not describe"),
    ("negative", "spans do not describe"),
    ("shape", "spans do not describe"),
    ("rows", "spans do not describe"),
])
def test_crafted_spans_are_refused_in_one_line(copy, craft, message):
    path = copy("fixed")
    spans_file = path / "shard-00001.spans.npy"
    spans = np.load(spans_file)
    if craft == "shifted":
        spans[:, 1:] -= 1
    elif craft == "swapped":
        spans[[0, -1]] = spans[[-1, 0]]
    elif craft == "overlap":
        spans[1, 1:] = spans[0, 1:] - 8
    elif craft == "past-end":
        spans[-1, 1:] += (path / "shard-00001.lmdb").stat().st_size
    elif craft == "negative":
        spans[0, 1] = -1
    elif craft == "shape":
        spans = spans[:, :2].copy()
    else:
        spans = spans[:-1]
    np.save(spans_file, spans)
    recompute_checksums(path)
    ds = open_dataset(path)
    first = ds.index_map.public(int(ds.store.starts[1]))  # a sample of shard 1
    for read in (lambda: ds[first], lambda: ds.read_payloads([first]), lambda: ds.get_batch([first])):
        with pytest.raises(PackerError, match=message) as err:
            read()
        assert "\n" not in str(err.value) and "shard-00001" in str(err.value)
    ds[ds.index_map.public(0)]  # the other shards still read


def shard_tree(path: Path) -> tuple[Tree, int]:
    """The B-tree of ``path`` as the reader reads it, and its descriptor (the caller closes it)."""
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=0)
    psize, txnid = env.stat()["psize"], env.info()["last_txnid"]
    env.close()
    fd = os.open(path, os.O_RDONLY)
    return Tree(fd, path, psize, txnid), fd


def test_a_middle_sample_is_compared_with_the_btree(copy):
    path = copy("encoded")
    spans_file = path / "shard-00000.spans.npy"
    spans = np.load(spans_file)
    tree, fd = shard_tree(path / "shard-00000.lmdb")
    os.close(fd)
    assert tree.depth == 1  # one leaf page: every sample of this small shard is compared
    spans[len(spans) // 2, 1:] -= 1  # one value, one byte early
    np.save(spans_file, spans)
    recompute_checksums(path)
    with pytest.raises(PackerError, match=f"sample {len(spans) // 2} lies at byte"):
        read_first(path)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """One shard of 3,000 raw samples, every third 2,100 bytes (in overflow pages, as photos are), the rest
    3 bytes (in the leaf pages): a B-tree of a root over ~16 leaf pages."""
    root = tmp_path_factory.mktemp("lmdbdeep")
    with Writer(root / "ds", format="lmdb") as w:
        for i in range(3000):
            w.add(np.full((1, 700 if i % 3 == 0 else 1, 3), i % 251, np.uint8), label=0)
    return root / "ds"


def test_the_btree_walk_finds_what_py_lmdb_finds_and_the_check_reads_no_value(deep, monkeypatch):
    """Walked page by page (``lmdb.pages``), every sample's value lies where py-lmdb's cursor finds it; the
    check on open reads the root and three leaves only, never a page of a value."""
    path = deep / "shard-00000.lmdb"
    tree, fd = shard_tree(path)
    try:
        assert tree.depth == 2 and tree.entries == 3000
        spans = spans_from_btree(tree, 3000)
        env = lmdb.open(str(path), subdir=False, readonly=True, lock=False, max_dbs=0)
        with env.begin(buffers=True) as txn:
            addr = [np.frombuffer(txn.get(key(p)), np.uint8) for p in (0, 1234, 1235, 2999)]
            base = np.frombuffer(txn.get(key(0)), np.uint8).ctypes.data - spans[0, 1]
            assert [a.ctypes.data - base for a in addr] == spans[[0, 1234, 1235, 2999], 1].tolist()
        env.close()
        assert np.array_equal(spans, np.load(deep / "shard-00000.spans.npy"))
        assert len(np.unique(spans[:, 0])) > 10
        read: list[int] = []
        real = Tree._read
        monkeypatch.setattr(Tree, "_read", lambda self, pgno: read.append(pgno) or real(self, pgno))
        check_against_btree(tree, spans, path, deep / "shard-00000.spans.npy")
        leaves = {int(spans[p, 0]) // tree.psize for p in (0, 1500, 2999)}
        assert set(read) == leaves | {tree.root} and len(read) == 3 + len(leaves)  # a root per descent
    finally:
        os.close(fd)


@pytest.mark.parametrize("pos", [0, 1500, 2999])
def test_every_sample_of_the_first_middle_and_last_leaf_is_compared(deep, tmp_path, pos):
    path = tmp_path / "ds"
    shutil.copytree(deep, path)
    spans = np.load(path / "shard-00000.spans.npy")
    leaf = np.flatnonzero(spans[:, 0] == spans[pos, 0])
    wrong = int(leaf[-1] if pos < 2999 else leaf[0])  # the other end of that leaf page
    spans[wrong, 1:] += 1
    np.save(path / "shard-00000.spans.npy", spans)
    recompute_checksums(path)
    with pytest.raises(PackerError, match=f"sample {wrong} lies at byte"):
        open_dataset(path).read_payload(0)


def test_a_dataset_without_spans_reads_views_found_by_walking_the_btree(copy):
    """Shards written before spans files existed: one walk of the leaf pages finds the same spans."""
    path = copy("fixed")
    expected = lmdb_values(path)
    written = [np.load(path / shard["files"][1]["name"])
               for shard in json.loads((path / "manifest.json").read_text())["shards"]]
    manifest = json.loads((path / "manifest.json").read_text())
    for shard in manifest["shards"]:
        (path / shard["files"][1]["name"]).unlink()
        shard["files"] = shard["files"][:1]
    (path / "manifest.json").write_text(json.dumps(manifest))
    recompute_checksums(path)
    ds = open_dataset(path, image="tensor")
    got = ds.payloads_at(np.arange(len(ds)))
    assert all(isinstance(p, memoryview) for p in got) and [bytes(p) for p in got] == expected
    assert all(np.array_equal(r.file_spans(list(range(len(r))))[0][0][1:], spans[0, 1:]) and
               np.array_equal(r._get().spans, spans) for r, spans in zip(ds.store.readers, written, strict=True))
    images, _ = ds.get_batch([3, 0, 20])
    assert np.array_equal(images.numpy(), np.stack([np.frombuffer(expected[ds.position(i)], np.uint8)
                                                    .reshape(16, 12, 3) for i in (3, 0, 20)]))


@pytest.mark.parametrize("fmt", ["lmdb", "memmap"])
def test_a_payload_held_after_close_still_reads_its_bytes(tmp_path, fmt):
    """Views keep their map alive: closing the dataset forgets the map, a payload held still reads the bytes
    it was given (not a crash), and the dataset reopens on its next read."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=3)
    path = convert(src, tmp_path / f"ds.{fmt}", to=fmt, workers=0, progress=False).output
    ds = open_dataset(path)
    held, expected = ds.read_payload(2), Path(src / ds.index.rel_path(ds.position(2))).read_bytes()
    many = ds.read_payloads([0, 1])
    ds.close()
    assert bytes(held) == expected and len(bytes(many[0])) == ds.index.nbytes[ds.position(0)]
    assert bytes(ds.read_payload(2)) == expected


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_read_views(request, start_method):
    base = request.getfixturevalue("spawned").context if start_method == "spawn" else request.getfixturevalue("bases")
    ds = open_dataset(base / "fixed", image="tensor")
    expected = np.stack([np.frombuffer(v, np.uint8).reshape(16, 12, 3) for v in lmdb_values(base / "fixed")])
    batches = list(BatchSampler(SequentialSampler(range(len(ds))), batch_size=5, drop_last=False))
    if start_method == "spawn":  # read by the session's spawned workers (_spawned_views)
        got = request.getfixturevalue("spawned").values()
    else:
        ds.read_payload(0)  # the parent has the shards open: forked workers must open their own
        got = DataLoader(ds.batched(), sampler=batches, batch_size=None, num_workers=2,
                         multiprocessing_context=start_method)
    for batch, (images, _labels) in zip(batches, got, strict=True):  # each batch in storage order
        assert np.array_equal(images.numpy(), expected[np.sort(ds.positions(batch))])


@probe_for(test_dataloader_workers_read_views)
def _spawned_views(tmp_path_factory):
    """Batches of 5 of a fixed-shape lmdb (several shards) through ``batched()``, as a DataLoader with
    batch_size=None and a batch sampler fetches them. Context: the folder of the datasets."""
    base = make_bases(tmp_path_factory.mktemp("lmdbviews"))
    ds = open_dataset(base / "fixed", image="tensor")
    ds.read_payload(0)
    return Fetch(ds.batched(), batches_of(len(ds), 5), default_convert, batched=False), base


def test_opening_a_shard_reads_its_leaf_pages_not_its_values(tmp_path, monkeypatch):
    """The spans check decodes the checked samples' leaf nodes and never reads their values (py-lmdb reads a
    whole value to hand it out: 8 values of 100 KB were 190 device reads on a cold open). On a cold file, opening
    brings in the pages the B-tree walk reads and no more: read-ahead off, and the header read before py-lmdb's
    (whose read-ahead mark, acted on by a later read of a marked page, brought in 16 pages of values on CI)."""
    from packer.diagnose.measure import evict, resident_pages

    src = make_imagefolder(tmp_path / "src", classes=2, per_class=8, size=(24, 32))
    for k, jpg in enumerate(sorted(src.rglob("*.jpg"))):  # values of 40 KB: overflow pages, as photos are
        jpg.write_bytes(jpg.read_bytes() + bytes([k % 251]) * 40_000)  # bytes after the JPEG's end are ignored
    ds = open_dataset(convert(src, tmp_path / "big.lmdb", to="lmdb", workers=0, progress=False).output)
    shard = ds.root / ds.manifest.shards[0].files[0].name
    if evict([shard]).verified is False:
        pytest.skip("page-cache residency can't be checked here (no mincore)")
    read: list[int] = []
    real = Tree._read
    monkeypatch.setattr(Tree, "_read", lambda self, pgno: read.append(pgno) or real(self, pgno))
    ds.store.readers[0].cached([0])  # opens the shard: the spans check runs
    assert {0, 1} <= set(read)
    assert resident_pages(shard)[0] * 4096 <= len(set(read)) * 4096 < 40_000  # less than one value


REPLACE = """
import os, shutil, sys
from packer import PackerError, open_dataset
ds = open_dataset(sys.argv[1])
shard = ds.root / ds.manifest.shards[0].files[0].name
os.replace(shard, sys.argv[2])
kind = sys.argv[3]
if kind == "fifo":
    os.mkfifo(shard)
elif kind == "directory":
    os.mkdir(shard)
else:
    os.symlink(sys.argv[2], shard)  # a valid LMDB file, outside the dataset
try:
    ds[ds.index_map.public(0)]  # a sample of the first shard
except PackerError as exc:
    print(exc)
"""


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink"])
def test_a_shard_replaced_after_the_dataset_opened_is_refused_not_waited_on_or_followed(copy, tmp_path, kind):
    """Shards open lazily: what lies at a shard's name when it opens must still be a regular file there (a FIFO
    hung py-lmdb's open; a link led outside the dataset)."""
    import subprocess
    import sys

    path = copy("encoded")
    res = subprocess.run([sys.executable, "-c", REPLACE, str(path), str(tmp_path / "elsewhere.lmdb"), kind],
                         capture_output=True, text=True, timeout=120)  # a hang fails here
    assert res.returncode == 0 and "shard-00000.lmdb" in res.stdout, res.stdout + res.stderr
    assert res.stdout.count("\n") == 1 and ("regular" in res.stdout or "outside the dataset" in res.stdout)
