"""``packer doctor URL``: the link to a packed dataset in object storage (first-byte latency and bandwidth, measured by
a few ranged GETs: packer/diagnose/link.py), what the dataset holds, and a few of its samples for the decoders, so
the verdict can say whether a reader would wait on the link or on decoding (``doctor_rules.link_or_decode_bound``)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from packer.storage.url import redact

SAMPLE_SHARD_BYTES = 64 << 20  # the largest shard fetched to take the decoders' samples from
SAMPLES = 16


def probe_remote(url: str, storage_options: Mapping[str, Any] | None, log: Callable[[str], None]) -> dict[str, Any]:
    """The dataset at ``url`` (opened into a temporary cache, removed after), a few of its stored samples (from its
    smallest shard, if at most ``SAMPLE_SHARD_BYTES``) and the link: ``{"data", "link", "samples", "samples_from"}``."""
    from packer.diagnose.bench_remote import largest_object
    from packer.diagnose.link import measure_link
    from packer.read.dataset import open_dataset

    tmp = tempfile.mkdtemp(prefix="packer-doctor-cache-")
    try:
        log(f"the dataset at {redact(url)}")
        ds = open_dataset(url, cache_dir=tmp, storage_options=storage_options)
        try:
            m = ds.manifest
            size = sum(f.num_bytes for f in m.all_files())
            data = {"kind": f"packed dataset at a URL ({m.format}, {m.payload})", "samples": len(ds), "bytes": size,
                    "mean_sample_bytes": size / max(len(ds), 1), "shards": len(m.shards)}
            samples, where = _samples(ds)
            largest = largest_object(m)
        finally:
            ds.close()
        log("the link: ranged GETs")
        link = measure_link(url, storage_options, largest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"data": data, "link": link, "samples": samples, "samples_from": where}


def _samples(ds: Any) -> tuple[list[bytes], str | None]:
    m = ds.manifest
    if m.payload != "encoded" or not m.shards:
        return [], None
    sizes = [sum(f.num_bytes for f in s.files) for s in m.shards]
    k = int(np.argmin(sizes))
    if sizes[k] > SAMPLE_SHARD_BYTES or not m.shards[k].num_samples:
        return [], None
    start = sum(s.num_samples for s in m.shards[:k])
    n = m.shards[k].num_samples
    positions = np.linspace(start, start + n - 1, min(SAMPLES, n)).astype(np.int64)
    out = [bytes(b) for b in ds.read_payloads(ds.index_map.public_many(positions))]
    return out, f"{len(out)} samples of {ds.manifest.shards[k].files[0].name} (fetched once)"
