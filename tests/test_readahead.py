"""Batch prefetch really brings a batch's bytes into the page cache ahead of the reads."""

import time

import pytest
from imagesets import make_imagefolder

from packer import convert, open_dataset
from packer.formats.base import merge_spans
from packer.measure import evict, resident_pages


def test_merge_spans_joins_neighbours_only():
    assert merge_spans([(10, 20), (0, 5), (5, 8), (3000, 4000)], gap=100) == [(0, 20), (3000, 4000)]
    assert merge_spans([], gap=1) == []


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
    ds.prefetch(list(range(10, 70)))
    deadline = time.time() + 10
    while resident_pages(shard)[0] - before < 20 and time.time() < deadline:
        time.sleep(0.01)
    resident, total = resident_pages(shard)
    assert resident - before >= 20, f"only {resident - before} of {total} pages came in"
