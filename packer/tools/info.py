"""What ``packer info`` shows: the manifest, plus statistics of the per-sample metadata."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from packer.layout.index import Index
from packer.layout.manifest import read_manifest
from packer.read.indexing import IMAGEFOLDER, IndexMap
from packer.units import human_bytes


def dataset_info(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest as a dict, with totals and label/shape/size statistics from ``meta/``."""
    root = Path(path)
    manifest = read_manifest(root)
    data = asdict(manifest)
    data["total_bytes"] = sum(f.num_bytes for f in manifest.all_files())
    data["num_files"] = len(manifest.all_files())
    index = Index.load(root, manifest.num_samples, files=manifest.meta_files, num_classes=len(manifest.classes))
    data["indexing"] = IndexMap.of(index).kind
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


def info_rows(path: str | os.PathLike, data: dict[str, Any]) -> list[tuple[str, str]]:
    """Human-readable (label, value) rows for the terminal."""
    classes = data["classes"]
    shown = ", ".join(classes[:8]) + (f", ... ({len(classes)} in all)" if len(classes) > 8 else "")
    payload = data["payload"] + (" (original file bytes)" if data["payload"] == "encoded" else " (HWC uint8 RGB)")
    rows = [
        ("dataset", str(path)),
        ("format", data["format"]),
        ("payload", payload),
        ("samples", f"{data['num_samples']:,}"),
        ("classes", f"{len(classes)}: {shown}" if classes else "none (flat folder, label -1)"),
        ("indexing", "ImageFolder's: ds[i] is ImageFolder(source)[i]" if data["indexing"] == IMAGEFOLDER else
         "stored order: ds[i] is the i-th stored sample (converted by an older packer)"),
    ]
    stats = data.get("stats")
    if stats:
        if stats["samples_per_class"]:
            s = stats["samples_per_class"]
            rows.append(("per class", f"{s['min']:,} to {s['max']:,} samples (median {s['median']:,.0f})"))
        if stats["height"] and stats["width"]:
            h, w = stats["height"], stats["width"]
            same = h["min"] == h["max"] and w["min"] == w["max"]
            rows.append(("image size", f"{h['min']}x{w['min']} (all)" if same else
                         f"height {h['min']}-{h['max']}, width {w['min']}-{w['max']}"))
        elif stats["sizes_known"] == 0:
            rows.append(("image size", "not recorded (converted with --validate none)"))
        rows.append(("per sample", f"{human_bytes(stats['payload_bytes']['mean'])} stored on average"))
    rows += [
        ("shards", f"{len(data['shards'])} ({data['num_files']} files), {human_bytes(data['total_bytes'])} in all"),
        ("not packed", f"{data['num_errors']} (see errors.json)" if data["num_errors"] else "0"),
        ("options", ", ".join(f"{k}={v}" for k, v in data["options"].items() if v is not None)),
        ("source", data["source"]),
        ("created", f"{data['created_at']} by {data['created_by']}"),
    ]
    if data["format"] == "mosaic" and data["shards"] and data["shards"][0]["files"]:
        rows.append(("look at", f"{Path(path) / data['shards'][0]['files'][0]['name']} (one mosaic)"))
    return rows
