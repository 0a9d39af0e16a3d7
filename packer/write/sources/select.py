"""Subsets of a scan, whatever the source: ``--classes`` (some classes, renumbered) and ``--split`` (train/val).

Both act on the scanned records before the sample order is applied, so they depend only on the
source, the class names, the fraction and the seed: the same command gives the same bytes. Each error
is reported once: a record that fails when read is in the errors.json of the part it was drawn into; what
the scan refused (a bad list row, a folder that can't be listed: no label to draw it by) only in train's.
"""

from __future__ import annotations

import math

import numpy as np

from packer._random import stable_permutation
from packer.errors import OptionError, arg
from packer.write.sources.base import SourceOptions
from packer.write.sources.records import ScanResult

PARTS = ("train", "val")
SCAN_ERRORS_IN_TRAIN = "refused by the scan: listed in the train part's errors.json"


def select_classes(scan: ScanResult, names: tuple[str, ...]) -> ScanResult:
    """The records of classes ``names``, renumbered as ImageFolder would number a folder holding only them
    (sorted names: index = position in that order); the others are counted in ``ignored``."""
    if not scan.classes:
        raise OptionError(f"{scan.root}: {arg('classes')} needs a source with classes (this one has none)")
    unknown = sorted(set(names) - set(scan.classes))
    if unknown:
        shown = ", ".join(scan.classes[:10]) + (" ..." if len(scan.classes) > 10 else "")
        raise OptionError(f"{arg('classes')}: {', '.join(unknown)} not among the source's classes ({shown})")
    kept = sorted(set(names))
    new_index = np.full(len(scan.classes) + 1, -1, dtype=np.int64)  # the last entry: label -1 (no class)
    for i, name in enumerate(kept):
        new_index[scan.classes.index(name)] = i
    remapped = new_index[scan.labels]
    positions = np.flatnonzero(remapped >= 0)
    out = scan.take(positions)
    out.labels = remapped[positions]
    out.classes = kept
    dropped = len(scan) - len(positions)
    if dropped:
        out.ignored = scan.ignored.copy()
        out.ignored["not in --classes"] += dropped
    return out


def split_positions(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Record positions of the train and val parts: per label, a seeded shuffle (packer._random), the first
    ``floor(fraction * n + 0.5)`` to train; each part in source order."""
    train: list[np.ndarray] = []
    for label in np.unique(labels):
        where = np.flatnonzero(labels == label)
        perm = stable_permutation(len(where), seed, int(label) + 1)
        train.append(where[perm[: math.floor(fraction * len(where) + 0.5)]])
    chosen = np.zeros(len(labels), dtype=bool)
    if train:
        chosen[np.concatenate(train)] = True
    return np.flatnonzero(chosen), np.flatnonzero(~chosen)


def select(scan: ScanResult, options: SourceOptions) -> ScanResult:
    """``scan`` narrowed by the options' ``classes``, then to the options' ``part`` of ``split``."""
    if options.classes is not None:
        scan = select_classes(scan, options.classes)
    if options.split is None:
        return scan
    if options.part not in PARTS:
        raise OptionError(f"{arg('split')}: part {options.part!r} (expected train or val)")
    if not 0.0 < options.split < 1.0:
        raise OptionError(f"{arg('split', options.split)}: expected a fraction between 0 and 1 (e.g. 0.9)")
    train, val = split_positions(scan.labels, options.split, options.split_seed)
    keep, other = (train, val) if options.part == "train" else (val, train)
    out = scan.take(keep)
    out.ignored = scan.ignored.copy()
    if len(other):
        out.ignored[f"in the {PARTS[1] if options.part == 'train' else PARTS[0]} part of --split"] += len(other)
    if options.part != PARTS[0] and scan.errors:  # each error once: what the scan refused is the train part's
        out.errors = []
        out.ignored[SCAN_ERRORS_IN_TRAIN] += len(scan.errors)
    return out
