"""What ``packer info`` shows: the manifest, plus statistics of the per-sample metadata. A dataset in object storage
(``s3://...``) shows the same rows: its metadata is fetched once into the node's cache (packer/layout/remote.py)
and the objects' sizes come from a listing instead of ``stat``."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from packer.errors import DatasetError
from packer.layout.index import Index
from packer.layout.manifest import Manifest, read_manifest
from packer.layout.remote import RemoteDataset, default_cache_dir, is_remote
from packer.read.indexing import IMAGEFOLDER, STORED, IndexMap, source_item
from packer.storage.url import parse, redact, refuse_url
from packer.units import human_bytes


def dataset_info(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None,
                 storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest as a dict, with totals and label/shape/size statistics from ``meta/``. A URL's metadata is
    kept in ``cache_dir`` (default: ``default_cache_dir()``); ``storage_options``: credentials and endpoint."""
    if is_remote(path):
        with RemoteDataset(str(path), cache_dir or default_cache_dir(), None, storage_options, strict=False) as ds:
            if ds.index is None:  # a meta file missing or of another size: nothing to describe
                raise DatasetError(ds.problems[0])
            return describe(ds.manifest, ds.index, ds.problems)
    refuse_url(path, "packer info")
    root = Path(path)
    manifest = read_manifest(root)
    # a stat per file, no hashing (packer verify's job): a shard truncated or replaced is shown, and exits 1
    problems = manifest.file_problems(root)
    index = Index.load(root, manifest.num_samples, files=manifest.meta_files, num_classes=len(manifest.classes),
                       source_records=manifest.source_records)
    return describe(manifest, index, problems)


def describe(manifest: Manifest, index: Index, problems: list[str]) -> dict[str, Any]:
    """``dataset_info``'s dict from a checked manifest and index, and the problems found with the files."""
    data = manifest.to_dict()
    data["problems"] = problems
    data["total_bytes"] = sum(f.num_bytes for f in manifest.all_files())
    data["num_files"] = len(manifest.all_files())
    index_map = IndexMap.of(index, manifest)
    data["indexing"] = index_map.kind
    data["source_records"] = index_map.records  # None: not recorded (an older dataset with files left out)
    if len(index):
        counts = np.bincount(index.labels[index.labels >= 0], minlength=len(manifest.classes))
        known = (index.heights > 0) & (index.widths > 0)
        data["stats"] = {
            "samples_per_class": {"min": int(counts.min()), "median": float(np.median(counts)),
                                  "max": int(counts.max())} if len(manifest.classes) else None,
            "height": _range(index.heights[known]),
            "width": _range(index.widths[known]),
            "sizes_known": int(known.sum()),
            "payload_bytes": {"mean": float(index.nbytes.mean()), "total": int(index.nbytes.sum())},
        }
    return data


def _range(values: np.ndarray) -> dict[str, int] | None:
    return {"min": int(values.min()), "max": int(values.max())} if len(values) else None


def class_names(classes: list[str], shown: int = 20, ends: int = 5) -> str:
    """Every class name when at most ``shown``, else the count with the first and last ``ends``."""
    if len(classes) <= shown:
        return f"{len(classes)}: {', '.join(classes)}"
    return f"{len(classes):,}: {', '.join(classes[:ends])}, ..., {', '.join(classes[-ends:])}"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def shards_row(data: dict[str, Any]) -> str:
    """What the shards are, in the format's own terms: files, one file per sample (bmp), mosaics."""
    shards = data["shards"]
    data_files = sum(len(s["files"]) for s in shards)
    where = f"in {_plural(len(shards), 'shard')}"
    if data["format"] == "mosaic":
        per = [n for s in shards for n in s.get("facts", {}).get("samples_per_mosaic", [])]
        facts = shards[0].get("facts", {}) if shards else {}
        tiles = "x".join(map(str, facts.get("tile", []))) or "?"
        grid = "x".join(map(str, facts.get("grid", []))) or "?"
        what = f"{_plural(len(per) or data_files, 'mosaic')} of up to {grid} tiles of {tiles} {where}"
    elif data_files >= data["num_samples"] > 1:
        what = f"{data_files:,} files, one per sample, {where}"
    else:
        what = f"{_plural(len(shards), 'shard')} ({_plural(data_files, 'file')})"
    meta = len(data.get("meta_files", []))
    return f"{what}, {_plural(meta, 'metadata file')}; {human_bytes(data['total_bytes'])} in all"


def _option_text(name: str, value: Any) -> str:
    """An option as people read it: sizes in bytes as "1 GiB" (a power-of-two multiple) or "512.0 MB"."""
    if name != "shard_bytes" or not isinstance(value, int) or isinstance(value, bool):
        return str(value)
    for unit, power in (("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if value % 1024**power == 0:
            return f"{value // 1024**power} {unit}"
    return human_bytes(value)


def order_rows(options: dict[str, Any]) -> list[tuple[str, str]]:
    """How samples are stored and which scan rules made the dataset (older manifests: those of their day)."""
    order = options.get("order", "source")
    stored = (f"shuffled (seed {options.get('seed', 0)}): neighbours on disk are unrelated" if order == "shuffled"
              else "ImageFolder's (source) order")
    if "skip_hidden" not in options:
        rules = "hidden names skipped, empty classes kept (made before these were options)"
    else:
        rules = ("hidden names skipped" if options["skip_hidden"] else "ImageFolder's: hidden folders and files kept")
        rules += ", empty classes kept" if options.get("allow_empty") else ""
    return [("order", stored), ("scan", rules)]


_SHOWN_APART = ("format", "payload", "order", "seed", "skip_hidden", "allow_empty", "jpeg_restarts")  # own rows
_PAYLOAD_TEXT = {  # (payload, jpeg_restarts) -> what each sample holds
    ("encoded", False): " (original file bytes)",
    ("encoded", True): " (JPEGs rewritten losslessly with a restart marker per MCU, --jpeg-restarts: the source's "
                       "pixels; other files' original bytes)",
    ("raw", False): " (HWC uint8 RGB)",
    ("raw", True): " (HWC uint8 RGB)",
    ("none", False): " (no images: fields and labels only)",
}


# how the source numbers its records, by source type: ds.imagefolder_index(i) is such a number
_NUMBERED = {"list": "the list's data rows, from 0", "archive": "its images in ImageFolder's order",
             "webdataset": "shard order, or a packer export's keys", "hf": "its rows, file by file",
             "recordio": "its records in file order", "packed": "as the re-packed dataset numbered its own source",
             "writer": "the order samples were added"}


def indexing_text(data: dict[str, Any]) -> str:
    """What ``ds[i]`` is, exactly: the claim "ds[i] is ImageFolder(source)[i]" only where it holds."""
    kind = data.get("source_type", "")
    at = partial(source_item, kind)
    how = f" ({_NUMBERED.get(kind, 'the source order')})" if kind not in ("", "folder") else ""
    if data["indexing"] == STORED:
        return "stored order: ds[i] is the i-th stored sample (converted by an older packer)"
    if data["indexing"] == IMAGEFOLDER:
        return f"ds[i] is {at('i')}{how}"
    records = data.get("source_records")
    if records is None:
        return (f"ds[i] is the i-th packed sample in the source's order, not {at('i')}: {data['num_errors']:,} "
                "not packed (an older packer did not record the mapping: convert again for ds.imagefolder_index)")
    return (f"ds[i] is {at('ds.imagefolder_index(i)')}{how}, not {at('i')}: {records - data['num_samples']:,} of "
            f"{records:,} source records not packed; ds.from_imagefolder(j) maps source index j here")


def info_rows(path: str | os.PathLike, data: dict[str, Any]) -> list[tuple[str, str]]:
    """Human-readable (label, value) rows for the terminal."""
    classes = data["classes"]
    payload = data["payload"] + _PAYLOAD_TEXT[data["payload"], bool(data["options"].get("jpeg_restarts"))]
    rows = [
        ("dataset", redact(str(path))),
        ("format", data["format"]),
        ("payload", payload),
        ("samples", f"{data['num_samples']:,}"),
        ("classes", class_names(classes) if classes else "none (flat folder, label -1)"),
        ("indexing", indexing_text(data)),
    ]
    if data.get("fields"):
        rows.append(("fields", ", ".join(f"{k}: {v}" for k, v in data["fields"].items())))
    stats = data.get("stats")
    if stats:
        if stats["samples_per_class"]:
            s = stats["samples_per_class"]
            rows.append(("per class", f"{s['min']:,} to {s['max']:,} samples (median {s['median']:,.0f})"))
        if data["payload"] == "none":
            pass  # no images: no sizes, no payload bytes
        elif stats["height"] and stats["width"]:
            h, w = stats["height"], stats["width"]
            same = h["min"] == h["max"] and w["min"] == w["max"]
            rows.append(("image size", f"{h['min']}x{w['min']} (all)" if same else
                         f"height {h['min']}-{h['max']}, width {w['min']}-{w['max']}"))
        elif stats["sizes_known"] == 0:
            rows.append(("image size", "not recorded (converted with --validate none)"))
        if data["payload"] != "none":
            rows.append(("per sample", f"{human_bytes(stats['payload_bytes']['mean'])} stored on average"))
    options = data["options"]
    rows += [
        ("shards", shards_row(data)),
        ("not packed", f"{data['num_errors']} (see errors.json)" if data["num_errors"] else "0"),
        *order_rows(options),
        ("options", ", ".join(f"{k}={_option_text(k, v)}" for k, v in options.items()
                              if v is not None and k not in _SHOWN_APART)),
        ("source", data["source"]),
        ("created", f"{data['created_at']} by {data['created_by']}"),
    ]
    if data["format"] == "mosaic" and data["shards"] and data["shards"][0]["files"]:
        first = data["shards"][0]["files"][0]["name"]
        shown = str(parse(path).join(first)) if is_remote(path) else str(Path(path) / first)
        rows.append(("look at", f"{shown} (one mosaic)"))
    problems = data.get("problems", [])
    rows += [("problem", p) for p in problems[:20]]
    if len(problems) > 20:
        rows.append(("problem", f"... and {len(problems) - 20:,} more"))
    if problems:
        rows.append(("check", f"packer verify {redact(str(path))} (checksums too); convert the dataset again to "
                     "repair it"))
    return rows
