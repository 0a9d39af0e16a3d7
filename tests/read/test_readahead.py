"""Batch read-ahead: the background thread brings a batch's bytes in, in file order, and callers wait per sample."""

import itertools
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from support.imagesets import make_imagefolder

from packer import convert, open_dataset
from packer.diagnose.measure import evict, resident_pages
from packer.pagecache import PageCache
from packer.read import readahead
from packer.read.hints import Ahead, Hinted, aheads_of
from packer.read.sampler import BlockShuffleSampler


def test_plan_merges_neighbours_on_one_file_in_order():
    job = readahead.plan([[("a", 0, 10)], [("a", 10, 20)], [], [("a", 5000, 6000)], [("b", 0, 5)], [("a", 20, 30)]],
                         gap=100)
    assert job.spans == [("a", 0, 30), ("a", 5000, 6000), ("b", 0, 5)]  # a recent span takes a neighbour
    assert job.need == [(0, 10), (0, 20), (-1, 0), (1, 6000), (2, 5), (0, 30)]
    far = readahead.plan([[("a", 0, 10)]] + [[("a", 1000 * i, 1000 * i + 1)] for i in range(1, 7)] + [[("a", 10, 20)]],
                         gap=100)
    assert len(far.spans) == 8 and far.need[-1] == (7, 20)  # beyond LOOKBACK spans: a new span


def test_plan_reads_no_gap_over_an_item_with_nothing_to_read():
    """A sample already cached between two that are not: their ranges are not joined over its bytes (read-ahead
    would copy them again), only where they overlap or touch."""
    job = readahead.plan([[("a", 0, 100)], [], [("a", 150, 300)], [("a", 320, 400)]], gap=100)
    assert job.spans == [("a", 0, 100), ("a", 150, 400)]  # after the cached item, gaps are read again
    assert job.need == [(0, 100), (-1, 0), (1, 300), (1, 400)]
    assert readahead.plan([[("a", 0, 100)], [], [("a", 100, 120)]], gap=100).spans == [("a", 0, 120)]  # touching
    assert readahead.plan([[("a", 0, 100)], [("a", 150, 300)]], gap=100).spans == [("a", 0, 300)]  # none between


def test_plan_merges_a_range_just_before_a_recent_span():
    """Bottom-up BMP mosaics: the next tiles' rows lie before the previous ones; still one span, read upwards."""
    job = readahead.plan([[("a", 3000, 4000)], [("a", 2000, 3000)], [("a", 1000, 1950)], [("a", 10, 20)]], gap=100)
    assert job.spans == [("a", 1000, 4000), ("a", 10, 20)]
    assert job.need == [(0, 4000), (0, 3000), (0, 1950), (1, 20)]
    assert job.arrival_order() == [2, 1, 0, 3]  # consume bottom-up bands as they come in


def test_forked_child_closes_the_files_its_parent_thread_held(tmp_path):
    """A worker forked while the parent's thread has files open does not keep copies of them."""
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    path = tmp_path / "held.bin"
    path.write_bytes(b"h" * 100)
    reader = readahead._reader()
    fd = os.open(path, os.O_RDONLY)
    reader.exact_fds[str(path)] = fd  # as if a read were under way
    try:
        pid = os.fork()
        if pid == 0:
            try:
                os.fstat(fd)
                os._exit(1)  # still open in the child
            except OSError:
                os._exit(0)
        _pid, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        reader.exact_fds.pop(str(path), None)
        os.close(fd)


def test_spans_are_read_in_pieces_from_their_start(tmp_path, monkeypatch):
    """The first pread of a span is a whole piece, not a stub up to an aligned offset: a read that
    follows no other is read as asked, so a stub would cost a device request of its own."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 * readahead.PIECE))
    calls = []
    real = os.preadv

    def spy(fd, buffers, offset):
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            calls.append((offset, sum(len(b) for b in buffers)))
        return real(fd, buffers, offset)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    monkeypatch.setattr(os, "preadv", spy)
    start, end = 1000, 1000 + 2 * readahead.PIECE + 7
    job = readahead.start([[(str(path), start, end)]])
    job.wait(0, timeout=10)
    assert calls == [(start, readahead.PIECE), (start + readahead.PIECE, readahead.PIECE),
                     (start + 2 * readahead.PIECE, 7)]


G = 1 << 16  # the device request size these tests pretend


@pytest.mark.parametrize("within, whole, want", [
    ((), False, [(1000, 2 * G + 1007)]),  # not in a block: as asked, in PIECE pieces (the test above)
    ([(0, 4 * G)], False, [(0, G), (G, 2 * G), (2 * G, 3 * G)]),  # inside a block: widened to the request grid
    # not past it, but from the page its first byte lies in (read whole anyway): requests stay page-aligned
    ([(500, 2 * G + 2000)], False, [(0, G), (G, 2 * G), (2 * G, 2 * G + 2000)]),
    ([(500, 2 * G + 2000)], True, [(0, G), (G, 2 * G), (2 * G, 3 * G)]),  # whole_cells: the edge request whole
])
def test_spans_are_read_in_whole_device_requests(tmp_path, monkeypatch, within, whole, want):
    """A span inside a block the order reads whole is widened to the device's request grid, never beyond the
    block (nor before the page it starts in), and read one request per piece (none split in two): asked of the
    kernel (``POSIX_FADV_WILLNEED``, nothing copied) and waited for by a one-byte read of its last byte; the
    bytes end up in the page cache."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(4 * G))
    evict([path])
    calls, waits = [], []
    real_read, real_advise = os.preadv, os.posix_fadvise

    def ours(fd):
        return os.readlink(f"/proc/self/fd/{fd}") == str(path)

    def read_spy(fd, buffers, offset):
        size = sum(len(b) for b in buffers)
        if ours(fd):
            (waits if within else calls).append((offset, offset + size))
        return real_read(fd, buffers, offset)

    def advise_spy(fd, offset, size, advice):
        if ours(fd) and advice == os.POSIX_FADV_WILLNEED:
            calls.append((offset, offset + size))
        return real_advise(fd, offset, size, advice)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    monkeypatch.setattr(os, "preadv", read_spy)
    monkeypatch.setattr(os, "posix_fadvise", advise_spy)
    monkeypatch.setattr(readahead, "request_bytes", lambda p: G)
    job = readahead.start([[(str(path), 1000, 2 * G + 1007)]], within=[(str(path), a, b) for a, b in within],
                          whole_cells=whole)
    job.wait(0, timeout=10)
    assert calls == want
    if within:
        assert waits == [(b - 1, b) for _a, b in want]  # each request waited for by its last byte
        assert PageCache(str(path)).resident(np.array([want[0][0]]), np.array([want[-1][1]]))


def test_a_whole_edge_request_stops_at_the_end_of_the_file(tmp_path):
    """Widened to the request grid past a block's end, a read still stops at the file's end, so its last byte
    exists and waiting for it waits for the bytes (past the end, the wait returned before they were read)."""
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(900_000))
    evict([path])
    grid = readahead.request_bytes(str(path))
    assert 900_000 % grid  # the file ends inside a request
    job = readahead.start([[(str(path), 800_000, 850_000)]], within=[(str(path), 0, 900_000)], whole_cells=True)
    assert job.reads == [(800_000 - 800_000 % grid, 900_000, True)]
    job.wait(0, timeout=10)
    assert PageCache(str(path)).resident(np.array([800_000]), np.array([850_000]))


def test_payloads_of_no_samples_are_none(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=3, size=(16, 16))
    ds = open_dataset(convert(src, tmp_path / "ds.lmdb", to="lmdb", workers=0, progress=False).output)
    assert ds.read_payloads([]) == [] and ds.payloads_at([]) == []


def test_request_bytes_follows_the_device_queue(tmp_path):
    """As many pages as one request takes (max_segments, max_sectors_kb, one bio's 256 pages); 254 pages where
    /sys says nothing (not a block device)."""
    page = os.sysconf("SC_PAGE_SIZE")
    assert readahead.request_bytes("/proc/self/status") == readahead.DEFAULT_REQUEST == 254 * 4096
    dev = os.stat(tmp_path).st_dev
    queue = next((q for q in (f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue",
                              f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/../queue") if os.path.isdir(q)), None)
    if queue is None:
        pytest.skip("no block device queue for the test directory")
    with open(f"{queue}/max_segments") as a, open(f"{queue}/max_sectors_kb") as b:
        want = min(int(a.read()) * page, int(b.read()) << 10, 256 * page, readahead.MAX_REQUEST)
    assert readahead.request_bytes(str(tmp_path)) == max(page, want)


def test_mosaic_run_of_tiles_is_one_span(tmp_path):
    """Neighbouring tiles of a (bottom-up) BMP mosaic lie in adjacent row bands: one span, not one per band."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(32, 32))
    ds = open_dataset(convert(src, tmp_path / "ds.mosaic", to="mosaic", tile="64x64", grid="2x24", workers=0,
                              progress=False).output)
    bands = ds.store.readers[0].file_spans([0, 24])
    assert bands[0][0][1] > bands[1][0][1]  # bottom-up: the second row of tiles lies first in the file
    assert bands[0][0][2] - bands[0][0][1] > readahead.GAP  # bands farther apart than merely "near"
    job = ds.read_ahead(list(range(40)))  # both rows
    assert job.spans == [(bands[1][0][0], bands[1][0][1], bands[0][0][2])]


def test_plan_item_with_several_ranges_waits_for_its_last():
    job = readahead.plan([[("a", 900, 1000), ("a", 0, 100)]], gap=10)
    assert job.spans == [("a", 0, 100), ("a", 900, 1000)]
    assert job.need == [(1, 1000)]


def test_start_reads_the_bytes_and_wait_returns(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(3 * readahead.PIECE + 123)
    path.write_bytes(data)
    job = readahead.start([[(str(path), 10, 20)], [(str(path), readahead.PIECE - 5, len(data))]])
    for k in range(2):
        job.wait(k, timeout=10)
    deadline = time.time() + 10
    while not job.done() and time.time() < deadline:
        time.sleep(0.01)
    assert job.done()


def test_missing_file_or_range_past_the_end_does_not_hang(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    job = readahead.start([[(str(tmp_path / "gone.bin"), 0, 10)], [(str(path), 50, 10_000)]])
    job.wait(0, timeout=10)
    job.wait(1, timeout=10)
    deadline = time.monotonic() + 60  # a bound against a hang, not a timing: the reader marks the job done after
    while not job.done() and time.monotonic() < deadline:  # waking the waiters
        time.sleep(0.01)
    assert job.done()


def test_empty_request_is_done_at_once():
    job = readahead.start([[], []])
    assert job.done()
    job.wait(0, timeout=0.1)


@pytest.mark.parametrize("fmt", ["lmdb", "memmap", "hdf5"])
def test_prefetch_brings_a_cold_batch_into_the_page_cache(tmp_path, fmt):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=40, size=(96, 128))
    res = convert(src, tmp_path / f"ds.{fmt}", to=fmt, workers=0, progress=False, order="source")
    ds = open_dataset(res.output)
    shard = res.output / ds.manifest.shards[0].files[0].name
    ds.read_payload(0)  # open the shard (maps headers) before measuring
    if evict([shard]).verified is False:
        pytest.skip("page-cache residency can't be checked here (no mincore)")
    before = resident_pages(shard)[0]
    pending = ds.read_ahead(list(range(69, 9, -1)))  # any order: read in file order
    for k in range(60):
        pending.wait(k, timeout=10)
    resident, total = resident_pages(shard)
    assert resident - before >= 20, f"only {resident - before} of {total} pages came in"
    spans = ds.store.readers[0].file_spans([10, 69])
    assert all(len(r) == 1 for r in spans)  # lmdb: values are read from its own map, not through the leaf page
    assert spans[0][-1][1] < spans[1][-1][1] and all(b - a == ds.index.nbytes[i] for i, r in zip((10, 69), spans)
                                                      for _p, a, b in r[-1:])


@pytest.mark.parametrize("fmt", ["lmdb", "memmap", "hdf5", "mosaic"])
def test_batches_read_with_read_ahead_equal_single_reads(tmp_path, fmt):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=30, size=(32, 32))
    extra = {"tile": "32x32"} if fmt == "mosaic" else {}
    out = convert(src, tmp_path / f"ds.{fmt}", to=fmt, workers=0, progress=False, shard_bytes=20_000, **extra).output
    ds = open_dataset(out, image="numpy")
    assert len(ds.manifest.shards) > 1
    rng = np.random.default_rng(0)
    for _ in range(5):
        idx = rng.choice(len(ds), size=17).tolist() + [3, 3]  # duplicates and shard crossings
        batch = ds.__getitems__(idx)
        single = [ds[i] for i in idx]
        assert all(np.array_equal(a[0], b[0]) and a[1] == b[1] for a, b in zip(batch, single, strict=True))
        payloads = ds.read_payloads(idx)
        assert all(bytes(memoryview(p).cast("B")) == bytes(memoryview(ds.read_payload(i)).cast("B"))
                   for p, i in zip(payloads, idx, strict=True))


def test_forked_loader_workers_get_their_own_thread(tmp_path):
    """The parent's read-ahead thread was used before the fork: workers still read every sample."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(32, 32))
    out = convert(src, tmp_path / "ds.lmdb", workers=0, progress=False).output
    ds = open_dataset(out, image="tensor")
    ds.__getitems__(list(range(10)))  # starts this process's thread
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2,
                                         multiprocessing_context="fork", collate_fn=lambda b: b)
    seen = sorted(int(lbl) for batch in loader for _img, lbl in batch)
    assert len(seen) == len(ds) and seen == sorted(ds.targets)


def test_thread_holds_no_files_open_when_idle(tmp_path):
    """Deleted datasets free their space: the idle thread has closed the files it read."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"y" * 10_000)
    code = f"""
import os, time
from packer.read import readahead
from packer.read.hints import Ahead, Hinted, aheads_of
from packer.read.sampler import BlockShuffleSampler
job = readahead.start([[({str(path)!r}, 0, 10_000)]])
job.wait(0, timeout=10)
deadline = time.time() + 10
while time.time() < deadline:
    held = [os.readlink(f"/proc/self/fd/{{f}}") for f in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{{f}}")]
    if not any(h.endswith("f.bin") for h in held):
        break
    time.sleep(0.02)
print("open" if any(h.endswith("f.bin") for h in held) else "closed")
"""
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "closed", out.stderr


def _lmdb(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=15, size=(40, 56))
    return convert(src, tmp_path / "ds.lmdb", workers=0, progress=False).output


def test_lmdb_spans_file_says_where_each_value_lies(tmp_path):
    out = _lmdb(tmp_path)
    ds = open_dataset(out)
    names = [f.name for f in ds.manifest.shards[0].files]
    assert names == ["shard-00000.lmdb", "shard-00000.spans.npy"]
    blob = (out / names[0]).read_bytes()
    spans = np.load(out / names[1])
    for i, ranges in enumerate(ds.store.readers[0].file_spans(list(range(len(ds))))):
        [(_p, a, b)] = ranges  # values come from the reader's own map: their bytes are all it touches
        assert blob[a:b] == bytes(ds.payload_at(i))  # file_spans, as readers, work in storage positions
        leaf = spans[i, 0]
        assert leaf % 4096 == 0 and (a, b) == tuple(spans[i, 1:]) and b"%010d" % i in blob[leaf:leaf + 4096]


def test_lmdb_without_spans_file_reads_with_read_ahead(tmp_path):
    """Datasets written before the spans file existed still read, batch path included, and read ahead (the
    spans are found by walking the B-tree's leaf pages)."""
    import json

    out = _lmdb(tmp_path)
    expected = [bytes(open_dataset(out).read_payload(i)) for i in range(30)]
    m = json.loads((out / "manifest.json").read_text())
    m["shards"][0]["files"] = m["shards"][0]["files"][:1]
    (out / "manifest.json").write_text(json.dumps(m))
    (out / "shard-00000.spans.npy").rename(tmp_path / "spans.npy")
    spans = np.load(tmp_path / "spans.npy")
    ds = open_dataset(out)
    assert ds.store.readers[0].file_spans([0, 5]) == [[(str(out / "shard-00000.lmdb"), *spans[p, 1:].tolist())]
                                                      for p in (0, 5)]
    assert [bytes(p) for p in ds.read_payloads(list(range(29, -1, -1)))] == expected[::-1]


def test_lmdb_crafted_spans_file_is_refused(tmp_path):
    from packer.errors import PackerError

    out = _lmdb(tmp_path)
    spans = np.load(out / "shard-00000.spans.npy")
    spans[3, 2] = 1 << 40  # past the end of the file
    np.save(out / "shard-00000.spans.npy", spans)
    ds = open_dataset(out)
    with pytest.raises(PackerError, match="spans.npy: spans do not describe"):
        ds.read_payloads([1, 2, 3])


def _settled(path, seconds: float = 10.0) -> int:
    """Resident bytes of ``path`` once nothing has come in for a while (background reads done)."""
    deadline, last = time.time() + seconds, -1
    while time.time() < deadline:
        now = resident_pages(path)[0] * 4096
        if now == last:
            return now
        last = now
        time.sleep(0.4)
    return last


def test_hints_survive_pickling_and_follow_the_rank_and_resume():
    """Indices reach spawn workers pickled; each rank's hints cover its own share of a block; a resumed
    iteration still yields hinted indices."""
    h = Hinted(7, (Ahead(3, 9), Ahead(20, 30)))
    back = pickle.loads(pickle.dumps([h, 8]))
    assert back == [7, 8] and isinstance(back[0], Hinted) and back[0].aheads == ((3, 9), (20, 30))
    assert aheads_of(back + [h]) == list(h.aheads)
    for rank in (0, 1):  # 4 blocks; ranks 0 and 1 split the second or third block in the epoch's order
        s = BlockShuffleSampler(list(range(100)), blocks=[0, 30, 60, 90, 100], num_replicas=2, rank=rank, warn=False)
        got = list(s)
        for i in got:  # a rank reads only inside its hints' ranges, and each range only as far as its share
            same = [j for j in got if j.aheads[0] == i.aheads[0]]
            assert i.aheads[0].first == min(same) and i.aheads[0].stop == max(same) + 1
        state = {"epoch": 0, "yielded": 10, "order": s.state_dict()["order"]}
        s.load_state_dict(state)
        rest = list(s)
        assert [int(i) for i in rest] == [int(i) for i in got[10:]] and all(isinstance(i, Hinted) for i in rest)


@pytest.mark.parametrize("fmt", ["memmap", "lmdb"])
def test_uniform_batches_after_a_block_sampler_read_only_their_bytes(tmp_path, fmt):
    """A block sampler existed, and was iterated, before a uniform-random DataLoader (forked workers) ran:
    cold, the bytes read from disk stay within 1.2x the bytes delivered (whole blocks were 6x here)."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=120, size=(24, 32))
    out = convert(src, tmp_path / f"ds.{fmt}", to=fmt, payload="raw", resize="224x224", workers=0,
                  progress=False).output
    ds = open_dataset(out, image="tensor")
    block = BlockShuffleSampler(ds, block_bytes=16_000_000, batch_size=8, warn=False)
    ds.__getitems__(list(itertools.islice(iter(block), 8)))  # this process read a block-order batch
    files = [out / f.name for shard in ds.manifest.shards for f in shard.files]
    for f in files:
        _settled(f)  # this process's own block read-ahead has finished
    if evict(files).verified is False:
        pytest.skip("page-cache residency can't be checked here (no mincore)")
    before = sum(_settled(f) for f in files)
    chosen = np.random.default_rng(0).permutation(len(ds))[:48].tolist()
    loader = torch.utils.data.DataLoader(ds, batch_size=8, sampler=chosen, num_workers=2, persistent_workers=True,
                                         multiprocessing_context="fork")
    delivered = sum(int(images.numel()) for images, _labels in loader)
    read = sum(_settled(f) for f in files) - before  # workers alive: any background read has had its time
    del loader
    assert delivered == 48 * 224 * 224 * 3
    assert read <= 1.2 * delivered, f"read {read:,} bytes from disk to deliver {delivered:,}"


def test_uniform_shuffle_reads_no_whole_blocks(tmp_path):
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(32, 32))
    ds = open_dataset(convert(src, tmp_path / "ds.memmap", to="memmap", workers=0, progress=False,
                              order="source").output)  # sample indices are storage positions
    job = ds.read_ahead([3, 30])
    # the two samples (and the gap between them, closer than readahead.GAP), nothing beyond
    assert [b - a for _p, a, b in job.spans] == [int(ds.index.nbytes[3:31].sum())]


def test_batch_is_decoded_in_the_order_its_bytes_arrive(tmp_path, monkeypatch):
    """Bottom-up mosaic: the second row's band is read first, so its tiles are consumed first."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(32, 32))
    ds = open_dataset(convert(src, tmp_path / "ds.mosaic", to="mosaic", tile="64x64", grid="2x24", workers=0,
                              progress=False).output, image="numpy")
    waited = []  # the read-ahead's items each chunk of the batch waits for, in the order the chunks run
    real = readahead.Pending.wait_all

    def spy(self, items):
        waited.extend(items)
        return real(self, items)

    monkeypatch.setattr(readahead.Pending, "wait_all", spy)
    monkeypatch.setattr(type(ds.store.readers[0]), "cached", lambda self, p: np.zeros(len(p), dtype=bool))  # as if cold
    batch = ds.__getitems__(list(range(40)))
    assert sorted(waited) == list(range(40)) and waited[:16] == list(range(24, 40))  # row 2 first
    assert all(np.array_equal(img, ds[i][0]) for i, (img, _label) in enumerate(batch))


@pytest.mark.parametrize("fits", [False, True])
def test_a_hinted_block_widens_reads_inside_it_only(tmp_path, monkeypatch, fits):
    """A block sampler's hint lets a sample's read grow to whole device requests within its block's bytes (data
    larger than half the free memory), or to the whole request at the block's edge (data that fits: the
    neighbour's part stays cached for its turn), whatever the access asked; an unhinted read stays exact."""
    from packer import sysinfo
    from packer.read.hints import Ahead, Hinted

    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(32, 32))
    out = convert(src, tmp_path / "ds.memmap", to="memmap", workers=0, progress=False, order="source").output
    monkeypatch.setattr(sysinfo, "memory_available", lambda: None if fits else 4096)
    ds = open_dataset(out, access="sequential")  # sample indices are storage positions
    assert ds.store.fits_in_memory == fits
    monkeypatch.setattr(readahead, "request_bytes", lambda p: 4096)
    offsets = np.concatenate([[0], np.cumsum(ds.index.nbytes)])
    block = (int(offsets[10]), int(offsets[30]))
    assert block[1] % 4096  # the block ends inside a request: clipping shows
    for i in (20, 29):  # inside the block, and its last sample
        job = ds.read_ahead([Hinted(i, (Ahead(10, 30),))])
        (path, a, b), = job.spans
        assert (a, b) == (offsets[i], offsets[i + 1])
        lo, hi = a - a % 4096, -(-b // 4096) * 4096
        want = (lo, hi) if fits else (max(block[0] - block[0] % 4096, lo), min(block[1], hi))
        assert job.reads == [(*want, True)] and want != (a, b)  # widened: samples do not lie on the grid
        assert ds.read_ahead([i]).reads == [(a, b, False)]
    assert (job.reads[0][1] > block[1]) == fits


def test_the_reader_thread_outlives_an_error_in_one_job(tmp_path, monkeypatch):
    """An error inside the read-ahead thread (here fadvise refused) neither ends it nor hangs a later batch."""
    f = tmp_path / "data"
    f.write_bytes(bytes(1 << 20))
    monkeypatch.setattr(readahead, "_READER", None)  # a thread of this test's own (the original comes back after)
    real = os.posix_fadvise
    calls = []

    def failing_once(*args):  # e.g. EINVAL/ESPIPE from a filesystem that refuses the advice
        calls.append(args)
        if len(calls) == 1:
            raise OSError(22, "Invalid argument")
        return real(*args)

    monkeypatch.setattr(os, "posix_fadvise", failing_once)
    span = [[(str(f), 4096, 8192)]]
    first = readahead.start(span, within=[(str(f), 0, 1 << 20)])  # inside a block: read exactly (fadvise)
    first.wait(0, timeout=5)
    assert first.done()
    second = readahead.start([[(str(f), 65536, 69632)]])
    second.wait(0, timeout=5)
    alive = readahead._READER is not None and readahead._READER.thread.is_alive()
    assert second.done() and alive, f"second job done={second.done()}, reader thread alive={alive}"


def test_a_block_over_several_files_is_widened_in_each(tmp_path):
    """n5 keeps its samples in block files of their own, so a block sampler's block covers several: its byte
    hull is worked out per file, and reads inside every one of them are widened and exact (the hull of a block's
    first and last sample alone, two files, was dropped: each file was then read in kernel read-ahead pieces,
    2-3 device requests per 1 MiB file under the emulated hard disk)."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(32, 32))
    ds = open_dataset(convert(src, tmp_path / "ds.n5", to="n5", n5_block=3000, workers=0, progress=False).output)
    sampler = BlockShuffleSampler(ds, block_bytes=int(ds.index.nbytes.sum()) // 2, seed=0)
    batch = list(sampler)[:6]
    (ahead,) = aheads_of(batch)[:1]
    hulls = ds.store._hulls([ahead])
    files = {path for path, _a, _b in hulls}
    assert len(files) == len(hulls) > 2  # one hull per block file of the block
    positions = np.arange(ahead.first, ahead.stop)
    spans = [r for rs in ds.store.readers[0].file_spans(positions.tolist()) for r in rs]
    assert all(any(p == path and a <= lo and hi <= b for path, a, b in hulls) for p, lo, hi in spans)
    job = ds.read_ahead(batch)
    job.wait(len(batch) - 1, timeout=10)
    assert job.reads and all(exact for _start, _stop, exact in job.reads)
    assert ds.store.hulls[ahead.first, ahead.stop] == hulls  # worked out once per block
