"""packer.pagecache and the readers' ``cached``: read-ahead is skipped only for bytes the kernel holds."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from support.imagesets import make_imagefolder

from packer import convert, open_dataset
from packer.diagnose.measure import evict
from packer.diagnose.system import fs_kind, mount_of
from packer.pagecache import PAGE, PageCache, SpanResidency


def _evict_or_skip(paths) -> None:
    """Drop ``paths`` from the page cache; skip unless the filesystem is a local disk's (tmpfs keeps its pages,
    overlay and network ones may). On a local disk a page that stays fails the test: something still maps it (a
    reader left open, a reference cycle keeping a map: one such hid as a skip here once)."""
    paths = list(paths)
    res = evict(paths)
    if res.fraction == 0.0:
        return
    mount = mount_of(paths[0])
    kind = fs_kind(mount["fstype"] if mount else None)
    if kind != "local" or not res.verified:
        pytest.skip(f"this filesystem ({kind}) keeps the pages: eviction cannot be shown")
    pytest.fail(f"{res.fraction:.0%} of the pages stayed cached after POSIX_FADV_DONTNEED on a {kind} filesystem "
                "(still mapped?)")


def test_a_file_read_is_resident_and_an_evicted_one_is_not(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(0).bytes(64 * PAGE))
    path.read_bytes()
    cache = PageCache(path)
    assert cache.resident(np.array([0, 10 * PAGE + 5]), np.array([PAGE, 40 * PAGE]))
    assert cache.resident(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) is False  # nothing asked
    assert not cache.resident(np.array([0]), np.array([65 * PAGE]))  # past the end: not known
    cache.close()
    _evict_or_skip([path])
    cache = PageCache(path)
    assert not cache.resident(np.array([3 * PAGE]), np.array([3 * PAGE + 10]))
    with open(path, "rb") as fh:  # one page read back: that page only
        fh.seek(3 * PAGE)
        fh.read(10)
    assert cache.resident(np.array([3 * PAGE]), np.array([3 * PAGE + 10]))
    assert not cache.resident(np.array([3 * PAGE, 50 * PAGE]), np.array([3 * PAGE + 10, 50 * PAGE + 1]))
    cache.close()


@pytest.mark.parametrize("fmt", ["lmdb", "memmap", "hdf5", "recordio", "n5", "pth", "safetensors"])
def test_read_ahead_is_skipped_for_cached_bytes_only(tmp_path, fmt):
    """lmdb and memmap ask about their samples' bytes their own way; the others through ``file_spans``."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(64, 64))
    ds = open_dataset(convert(src, tmp_path / f"ds.{fmt}", to=fmt, workers=0, progress=False).output)
    idx = np.array([1, 7, 30])
    expected = [bytes(p) for p in ds.payloads_at(idx)]  # read once: cached
    reader = ds.store.readers[0]
    assert reader.cached(idx.tolist()).all()
    assert not ds.source.start(idx).spans  # warm: nothing read ahead
    pending = ds.read_ahead(idx.tolist())
    assert pending.spans  # asked for explicitly: planned all the same
    for k in range(len(idx)):  # let it finish: a read still under way after the eviction would cache pages again
        pending.wait(k)
    ds.close()
    files = [p for p in ds.root.rglob("*") if p.is_file()]  # n5: block files in subfolders
    _evict_or_skip(files)
    ds = open_dataset(ds.root)
    assert not ds.store.readers[0].cached(idx.tolist()).all()
    assert ds.source.start(idx).spans  # cold: read ahead
    assert [bytes(p) for p in ds.payloads_at(idx)] == expected


def test_a_whole_file_seen_cached_is_asked_about_again_once_evicted(tmp_path):
    """A file seen whole in the cache answers from that for a while, but an eviction is noticed at once."""
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(1).bytes(32 * PAGE))
    path.read_bytes()
    cache = PageCache(path)
    assert cache.resident(np.array([0]), np.array([PAGE]))
    assert cache.resident(np.array([5 * PAGE, 20 * PAGE]), np.array([9 * PAGE, 32 * PAGE]))
    _evict_or_skip([path])
    assert not cache.resident(np.array([7 * PAGE]), np.array([7 * PAGE + 1]))
    with open(path, "rb") as fh:  # one page read back: that page only, not the file
        fh.seek(3 * PAGE)
        fh.read(10)
    assert not cache.resident(np.array([3 * PAGE, 20 * PAGE]), np.array([3 * PAGE + 10, 20 * PAGE + 1]))
    cache.close()


def test_whole_file_means_the_pages_that_hold_samples(tmp_path):
    """With ``holding`` (an LMDB file's values), pages outside it (B-tree pages, never read once the values
    are located) do not keep the file from counting as cached whole; a holding page evicted does."""
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(1).bytes(32 * PAGE))
    _evict_or_skip([path])
    starts, ends = np.array([PAGE + 16, 9 * PAGE]), np.array([8 * PAGE, 20 * PAGE - 7])  # pages 1-7, 9-19
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # these pages only, no read-ahead around them
        for a, b in zip(starts.tolist(), ends.tolist()):
            os.pread(fd, b - a, a)
    finally:
        os.close(fd)
    first = (np.array([2 * PAGE]), np.array([3 * PAGE]))
    held = PageCache(path, holding=(starts, ends))
    assert held.resident(*first) and held._whole  # answered from the whole-file check
    plain = PageCache(path)
    assert plain.resident(*first) and not plain._whole  # page 0, 8 and 20-31 never read: range by range
    held.close()
    plain.close()
    evict([path])
    held = PageCache(path, holding=(starts, ends))
    assert not held.resident(*first) and not held._whole
    held.close()


def test_an_hdf5_shard_counts_as_cached_whole_without_its_metadata_pages(tmp_path):
    """HDF5's own pages (read at open, dropped from the cache since: this VM's DAMON drops idle pages) do not keep a
    shard whose samples are all cached from the whole-file answer (without it, every batch was asked about range by
    range: 370 against 30 us per batch of 64 photos)."""
    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(160, 160))
    ds = open_dataset(convert(src, tmp_path / "ds.hdf5", to="hdf5", workers=0, progress=False).output)
    reader = ds.store.readers[0]
    mapped = reader._get().mapped  # opened: HDF5 has read its metadata
    spans = [span for spans in reader.file_spans(list(range(len(ds)))) for span in spans]  # chunks looked up
    path = str(mapped.path)
    _evict_or_skip([mapped.path])
    _read_exactly(spans)
    plain = PageCache(path)
    assert not plain.resident(np.array([0]), np.array([os.path.getsize(path)]))  # some metadata page is not cached
    plain.close()
    assert reader.cached(list(range(len(ds)))).all()
    assert mapped._residency._whole  # answered by the whole-file check
    ds.close()


def test_holding_ranges_are_made_only_for_a_file_asked_about_whole(tmp_path, monkeypatch):
    """``holding`` may be what makes the ranges (HDF5 looks up every chunk for them: 10 us each, a second per
    100 GB shard): called once, and never for a file too large to be asked about whole."""
    import packer.pagecache as pagecache

    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(3).bytes(16 * PAGE))
    path.read_bytes()
    calls = []

    def holding():
        calls.append(1)
        return np.array([0]), np.array([16 * PAGE])

    for limit, made in ((8, 0), (16, 1)):  # pages asked about whole at most
        monkeypatch.setattr(pagecache, "WHOLE_FILE_PAGES", limit)
        calls.clear()
        cache = PageCache(path, holding=holding)
        for k in range(3):
            assert cache.resident(np.array([k * PAGE]), np.array([(k + 2) * PAGE]))
            cache._whole_until = -1.0  # the whole-file answer asked again each time
        assert len(calls) == made
        cache.close()


def test_span_residency_keeps_a_bounded_number_of_files_mapped(tmp_path):
    paths = []
    for k in range(5):
        paths.append(tmp_path / f"f{k}.bin")
        paths[-1].write_bytes(bytes(4 * PAGE))
        paths[-1].read_bytes()
    res = SpanResidency(keep=2)
    for p in paths:
        assert res.each([[(str(p), 0, PAGE)], [(str(p), 2 * PAGE, 3 * PAGE + 1)]]).all()
    files = res._files.get()
    assert list(files.caches) == [str(paths[3]), str(paths[4])]  # the two asked last
    assert res.each([]).tolist() == []  # nothing asked
    assert res.each([[(str(paths[0]), 0, PAGE)], []]).tolist() == [True, False]  # the second's bytes not known
    restored = pickle.loads(pickle.dumps(res))  # a spawned worker's copy: empty, works on its own
    assert restored._files.peek() is None and restored.each([[(str(paths[1]), 0, 10)]]).all()
    res.close()
    assert res._files.peek() is None
    _evict_or_skip([paths[1]])
    assert not restored.each([[(str(paths[1]), 0, 10)], [(str(paths[2]), 0, 10)]]).all()


def test_span_residency_asks_a_small_hull_in_one_call_and_a_large_file_range_by_range(tmp_path, monkeypatch):
    """Ranges within HULL_BYTES (an N5 block's samples) are asked about as one hull; farther ones exactly, so a
    page evicted between two ranges a MiB apart does not make them look uncached. A file seen whole in the cache
    has only a hull's first page asked about for WHOLE_FILE_SECONDS: an eviction there is noticed at once, one
    further in once the answer is old."""
    from packer import pagecache

    small, large = tmp_path / "block", tmp_path / "big"
    small.write_bytes(np.random.default_rng(0).bytes(64 * PAGE))
    large.write_bytes(np.random.default_rng(1).bytes(pagecache.HULL_BYTES + 64 * PAGE))
    res = SpanResidency()
    near = [[(str(small), 0, PAGE)], [(str(small), 40 * PAGE, 41 * PAGE)]]
    far = [[(str(large), 0, PAGE)], [(str(large), pagecache.HULL_BYTES + 40 * PAGE, pagecache.HULL_BYTES + 41 * PAGE)]]
    evict([small, large])  # read back below: cached in read-ahead's folios, not in the writes' larger ones
    small.read_bytes(), large.read_bytes()
    assert res.each(near).all() and res.each(far).all()
    for path, first in ((small, 32), (large, 16)):  # small: pages asked about; large: pages between the ranges
        with open(path, "rb") as fh:  # 16 aligned pages: a single one may share a large folio that stays
            os.posix_fadvise(fh.fileno(), first * PAGE, 16 * PAGE, os.POSIX_FADV_DONTNEED)
    if any(PageCache(path).resident(np.array([page * PAGE]), np.array([page * PAGE + 1]))
           for path, page in ((small, 40), (large, 20))):
        pytest.skip("this filesystem keeps the pages (tmpfs?): eviction cannot be shown")
    assert not res.each([[(str(small), 40 * PAGE, 41 * PAGE)], [(str(small), 44 * PAGE, 45 * PAGE)]]).all()
    monkeypatch.setattr(pagecache, "WHOLE_FILE_SECONDS", 0.0)  # whole-file answers asked again every time
    assert not res.each(near).all()  # an asked page is gone: the hull's single call says so
    assert res.each(far).all()  # only pages outside both ranges are gone (their hull would have said no)
    res.close()


@pytest.mark.parametrize("soft, keep", [(256, 64), (1024, 64), (4096, 256), (20000, 1024), (None, 1024)])
def test_files_kept_mapped_follow_the_open_file_limit(monkeypatch, soft, keep):
    """Each map holds a descriptor: a sixteenth of the soft limit, at least 64, at most 1,024 (also unlimited)."""
    import resource

    from packer import pagecache
    value = resource.RLIM_INFINITY if soft is None else soft
    monkeypatch.setattr(resource, "getrlimit", lambda which: (value, value))
    assert pagecache.mapped_files_limit() == keep


def _read_exactly(ranges) -> None:
    """Bring exactly these (path, start, end) ranges into the page cache: no read-ahead around them."""
    for path, start, end in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.pread(fd, end - start, start)
        finally:
            os.close(fd)


def test_span_residency_answers_ranges_of_several_files_at_once(tmp_path):
    """``SpanResidency.ranges`` (N5's blocks: arrays, not ``file_spans``' lists), files interleaved and repeated,
    answers each range as its file's ``resident_each`` does, and as ``each`` does sample by sample."""
    paths = [tmp_path / f"f{k}.bin" for k in range(3)]
    for k, p in enumerate(paths):
        p.write_bytes(np.random.default_rng(k).bytes(16 * PAGE))
    _evict_or_skip(paths)
    _read_exactly([(str(paths[0]), 2 * PAGE, 5 * PAGE), (str(paths[2]), 0, 16 * PAGE)])
    rng = np.random.default_rng(7)
    file_of = rng.integers(0, 3, 40)
    starts = rng.integers(0, 15, 40) * PAGE + rng.integers(0, PAGE, 40)
    ends = np.minimum(starts + rng.integers(0, 3 * PAGE, 40), 16 * PAGE)
    got = SpanResidency().ranges([str(p) for p in paths], file_of, starts, ends)
    for k in range(3):
        cache = PageCache(paths[k])
        assert got[file_of == k].tolist() == cache.resident_each(starts[file_of == k], ends[file_of == k]).tolist()
        cache.close()
    assert 0 < got.sum() < len(got)
    spans = [[(str(paths[f]), s, e)] for f, s, e in zip(file_of.tolist(), starts.tolist(), ends.tolist())]
    assert SpanResidency().each(spans).tolist() == got.tolist()
    assert SpanResidency().ranges([], *(np.array([], dtype=np.int64),) * 3).tolist() == []


def test_hull_each_answers_as_resident_each_from_one_call(tmp_path, monkeypatch):
    """``PageCache.hull_each`` (ranges within a small hull, N5's block files) gives ``resident_each``'s answers
    with the hull's pages all cached, none cached (a cold batch: answered without working out each range's pages)
    and some cached; empty ranges (one at the hull's page-aligned end) are cached, a hull past the end is not
    known."""
    from packer import pagecache

    monkeypatch.setattr(pagecache, "WHOLE_FILE_SECONDS", 0.0)  # no whole-file answer kept between the states
    path = tmp_path / "block.bin"
    path.write_bytes(np.random.default_rng(3).bytes(48 * PAGE))
    rng = np.random.default_rng(4)
    starts = rng.integers(0, 40, 30) * PAGE + rng.integers(0, PAGE, 30)
    ends = np.minimum(starts + rng.integers(0, 4 * PAGE, 30), 40 * PAGE)
    starts, ends = np.append(starts, 40 * PAGE), np.append(ends, 40 * PAGE)  # empty, at the hull's end
    first, last = int(starts.min()), int(ends.max())
    cache = PageCache(path)
    states = []
    for k, prepare in enumerate((lambda: path.read_bytes(), lambda: None, lambda: _read_exactly(
            [(str(path), 5 * PAGE, 9 * PAGE), (str(path), 20 * PAGE, 31 * PAGE)]))):
        if k:
            _evict_or_skip([path])
        prepare()
        want = cache.resident_each(starts, ends)
        assert cache.hull_each(starts, ends, first, last).tolist() == want.tolist()
        states.append(int(want.sum()))
    assert states[0] == len(starts) and states[1] == int((ends <= starts).sum())
    assert 0 < states[1] < states[2] < len(starts)
    past = cache.hull_each(np.array([0]), np.array([49 * PAGE]), 0, 49 * PAGE)
    assert past.tolist() == [False]  # past the end: not known
    path.read_bytes()  # an empty range past the end has nothing to read: it leaves the others' answers alone
    for s_, e_ in (([0, 60 * PAGE], [PAGE, 60 * PAGE]), ([0, 60 * PAGE], [PAGE, 50 * PAGE])):
        starts, ends = np.array(s_), np.array(e_)
        want = cache.resident_each(starts, ends)
        assert want.tolist() == [True, True]
        assert cache.hull_each(starts, ends, int(starts.min()), int(ends.max())).tolist() == want.tolist()
    cache.close()


def test_resident_each_answers_range_by_range(tmp_path):
    path = tmp_path / "data.bin"
    path.write_bytes(np.random.default_rng(2).bytes(64 * PAGE))
    _evict_or_skip([path])
    _read_exactly([(str(path), 3 * PAGE, 3 * PAGE + 10), (str(path), 40 * PAGE, 42 * PAGE)])
    cache = PageCache(path)
    got = cache.resident_each(np.array([3 * PAGE, 10 * PAGE, 5, 40 * PAGE + 1, 41 * PAGE]),
                              np.array([3 * PAGE + 10, 12 * PAGE, 5, 42 * PAGE, 43 * PAGE]))
    assert got.tolist() == [True, False, True, True, False]  # an empty range has nothing to read
    assert cache.resident_each(np.array([0]), np.array([65 * PAGE])).tolist() == [False]  # past the end: not known
    assert cache.resident_each(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).tolist() == []
    cache.close()


@pytest.mark.parametrize("fmt", ["lmdb", "memmap", "hdf5", "recordio", "n5"])
def test_read_ahead_leaves_out_the_samples_already_cached(tmp_path, fmt):
    """A batch with some samples in the page cache and some not has only the others read ahead: a page the decoder
    never touches (an EXIF thumbnail's), evicted, no longer has the whole batch copied again every epoch. The
    formats' batch-at-a-time answers equal the default one from ``file_spans``."""
    from packer.formats.base import ShardReader

    src = make_imagefolder(tmp_path / "src", classes=2, per_class=20, size=(160, 160))
    ds = open_dataset(convert(src, tmp_path / f"ds.{fmt}", to=fmt, workers=0, progress=False).output)
    positions = ds.positions([1, 17, 33])
    expected = [bytes(p) for p in ds.payloads_at(positions)]
    assert min(map(len, expected)) > 3 * PAGE  # each sample has pages of its own
    ds.close()
    _evict_or_skip([p for p in ds.root.rglob("*") if p.is_file()])
    ds = open_dataset(ds.root)
    reader = ds.store.readers[0]
    positions = positions.tolist()
    _read_exactly(reader.file_spans([positions[1]])[0])  # the middle sample's bytes only
    assert reader.cached(positions).tolist() == [False, True, False]
    assert ShardReader.cached(reader, positions).tolist() == [False, True, False]
    pending = ds.source.start(np.array(positions))
    assert [need != (-1, 0) for need in pending.need] == [True, False, True]  # storage order, here the asked one
    _path, start, end = reader.file_spans([positions[1]])[0][-1]  # the middle sample's own bytes: not read again
    assert not any(a < end and start < b for _p, a, b in pending.spans)
    assert [bytes(p) for p in ds.payloads_at(np.array(positions), pending=pending)] == expected


def test_a_reader_overriding_the_old_in_page_cache_is_refused_when_defined():
    """``in_page_cache`` (one answer per batch) became ``cached`` (one per sample): an override under the old name
    would silently never be called, so defining one fails at once, naming the new hook."""
    from packer.formats.base import ShardReader

    with pytest.raises(TypeError, match="cached"):
        type("OldReader", (ShardReader,), {"in_page_cache": lambda self, positions: True})
