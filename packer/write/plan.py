"""Planning a conversion: the sample order, the payload size estimate, the shards, the free-space check,
and the plan journaled in ``<out>.partial`` before any shard is written (a resumed run reads it back).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from packer._random import stable_permutation
from packer.errors import OutputExistsError, PackerError, arg
from packer.formats import get_format
from packer.images.decode import DecodeError, pixel_limit
from packer.images.headers import image_size
from packer.layout.partial import JOURNAL_DIR, PLAN_NAME
from packer.write.journal import scan_digest
from packer.write.lock import OutputLock
from packer.write.options import ConvertOptions
from packer.write.output import Output
from packer.write.sources.base import RecordError
from packer.write.sources.records import ScanResult


def estimate_sample_bytes(scan: ScanResult, options: ConvertOptions, probes: int = 64) -> float:
    """Mean payload size from a deterministic sample of the records (no full stat pass).

    Encoded: the records' stored sizes; raw: the pixels their headers promise (a sequential source,
    read only in order, gives its stored sizes: shards of raw payloads then come out larger), leaving out
    images over the pixel limit (refused when converted, never written: a 65000x65000 bomb promised 12 GB).
    """
    n = len(scan)
    reader = scan.source_reader()
    picks = sorted({int(i) for i in np.linspace(0, n - 1, num=min(n, probes))})
    sizes = []
    for i in picks:
        rel, loc = scan.rel_paths[i], scan.loc(i)
        try:
            size = reader.size(rel, loc)
            if size is not None and (options.payload != "raw" or reader.sequential):
                sizes.append(size)
                continue
            if reader.sequential:
                continue
            data = reader.read(rel, loc)[0]
            if isinstance(data, np.ndarray):
                h, w = data.shape[:2]
            elif options.payload != "raw":
                sizes.append(len(data))
                continue
            else:
                h, w = image_size(data[: 1 << 20])
            limit = pixel_limit()
            if limit is not None and h * w > limit:
                continue
            spec = options.resize_spec
            if spec is not None:
                h, w = spec.output_shape(h, w)
            sizes.append(h * w * 3)
        except (RecordError, DecodeError):
            continue
    return float(np.mean(sizes)) if sizes else 1.0


def plan_shards(num_files: int, mean_bytes: float, shard_bytes: int | None, multiple: int = 1) -> list[tuple[int, int]]:
    """Split source positions into (start, stop) runs of roughly ``shard_bytes`` each.

    ``multiple``: a format's natural unit (mosaic: tiles per mosaic); shards holding more than
    one are rounded down to whole units, so only a shard's last unit can be partly filled.
    """
    if shard_bytes is None:
        return [(0, num_files)]
    per_shard = max(1, int(shard_bytes // max(mean_bytes, 1.0)))
    if per_shard > multiple > 1:
        per_shard -= per_shard % multiple
    return [(s, min(s + per_shard, num_files)) for s in range(0, num_files, per_shard)]


def shard_multiple(options: ConvertOptions) -> int:
    """The format's natural unit of samples per shard (1 for most; mosaic: tiles per mosaic)."""
    return int(get_format(options.format).shard_multiple(options.record()))


def apply_order(scan: ScanResult, order: str, seed: int) -> ScanResult:
    """The scan with its samples in dataset order: as found (ImageFolder's), or a seeded shuffle.

    The permutation depends only on (seed, number of files), never on ``workers``, and comes
    from numpy's stable PCG64 stream, so the same seed gives the same bytes everywhere.
    """
    if order == "source":
        return scan
    return scan.take(stable_permutation(len(scan), seed))


def check_free_space(directory: Path, needed: float) -> None:
    free = shutil.disk_usage(directory).free
    if needed * 1.05 > free:
        raise PackerError(
            f"{directory}: not enough free disk space: the output needs about {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB free (choose another {arg('output')}, or {arg('resize')} for raw payloads)"
        )


def load_or_make_plan(scan: ScanResult, output: Output, options: ConvertOptions,
                      resume: bool) -> tuple[dict, OutputLock]:
    """The shard plan: the journaled one when resuming, else a new one (written before any shard); and the
    lock on the output's folder the run then holds (``write.lock``).

    An existing folder is used only when its journal shows packer made it, and never
    deleted here: one that packer did not make is refused, naming it; one a live run holds, naming its pid.
    """
    recorded = options.record()
    digest = scan_digest(scan)
    partial = output.folder
    if output.left_over():
        plan = output.plan()
        if plan is None:
            raise OutputExistsError(f"{partial}: exists but was not made by packer (it holds no "
                                    f"{JOURNAL_DIR}/{PLAN_NAME}), so packer leaves it alone: move it away, or choose "
                                    f"another {arg('output')}")
        output.check_free()  # before anything is said of it: a live run's is in use, not left over
        if not resume:
            raise OutputExistsError(output.left_over_reason())
        if plan.get("options") != recorded or plan.get("digest") != digest:
            raise OutputExistsError(output.not_resumable("the source files or the options changed since the "
                                                         "interrupted run"))
        return plan, output.take()
    output.make_parent()
    mean_bytes = estimate_sample_bytes(scan, options)
    shards = plan_shards(len(scan), mean_bytes, options.shard_bytes, shard_multiple(options))
    needed = mean_bytes * len(scan)
    check_free_space(output.path.parent, output.staged_bytes(needed, needed / max(1, len(shards))))
    plan = {"options": recorded, "digest": digest, "source": str(scan.root), "num_files": len(scan),
            "shards": shards, "mean_bytes": mean_bytes}
    return plan, output.start(plan)
