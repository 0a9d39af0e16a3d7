"""How well an order shuffles, for comparing samplers (``examples/shuffle_quality.py``, docs/sampling.md): the
locality of its reads, the label mix of its batches, and how often samples share a batch again."""

from __future__ import annotations

import numpy as np


def shuffle_stats(
    order: np.ndarray,
    labels: np.ndarray | None = None,
    batch_size: int = 256,
    bounds: np.ndarray | None = None,
) -> dict[str, float]:
    """Locality and label mixing of an epoch order, for comparing samplers.

    - ``gap_median`` / ``gap_mean_frac``: distance between consecutive samples' positions
      (median, in samples; mean, as a fraction of the dataset: 1/3 for a uniform shuffle);
    - ``gap_le_block``: fraction of consecutive pairs less than one mean block apart;
    - ``runs_per_batch``: contiguous runs in a sorted batch (reads ``__getitems__`` makes);
    - ``blocks_per_batch``: distinct blocks a batch touches (with ``bounds``);
    - ``classes_per_batch``: distinct labels per batch;
    - ``label_tv``: mean total-variation distance between a batch's label histogram and the
      whole dataset's (0 = same mix; uniform shuffling is the reference to compare with).
    """
    order = np.asarray(order, dtype=np.int64)
    n = int(order.max()) + 1 if len(order) else 0
    gaps = np.abs(np.diff(order))
    out: dict[str, float] = {
        "gap_median": float(np.median(gaps)) if len(gaps) else 0.0,
        "gap_mean_frac": float(gaps.mean() / max(n, 1)) if len(gaps) else 0.0,
    }
    nbatch = len(order) // batch_size
    batches = np.sort(order[: nbatch * batch_size].reshape(nbatch, batch_size), axis=1)
    out["runs_per_batch"] = float(np.mean(1 + np.sum(np.diff(batches, axis=1) != 1, axis=1))) if nbatch else 0.0
    if bounds is not None:
        mean_block = n / max(len(bounds) - 1, 1)
        out["gap_le_block"] = float(np.mean(gaps < mean_block)) if len(gaps) else 0.0
        blk = np.searchsorted(bounds, batches, side="right") - 1
        out["blocks_per_batch"] = float(np.mean(1 + np.sum(np.diff(blk, axis=1) != 0, axis=1))) if nbatch else 0.0
    if labels is not None and nbatch:
        labels = np.asarray(labels, dtype=np.int64)
        values, codes = np.unique(labels, return_inverse=True)
        k = len(values)
        global_p = np.bincount(codes, minlength=k) / len(codes)
        bl = codes[order[: nbatch * batch_size]].reshape(nbatch, batch_size)
        counts = np.zeros((nbatch, k), dtype=np.int64)
        np.add.at(counts, (np.repeat(np.arange(nbatch), batch_size), bl.ravel()), 1)
        out["classes_per_batch"] = float(np.mean(np.sum(counts > 0, axis=1)))
        out["label_tv"] = float(np.mean(0.5 * np.abs(counts / batch_size - global_p).sum(axis=1)))
    return out


def batchmates_again(order_a: np.ndarray, order_b: np.ndarray, batch_size: int) -> float:
    """Fraction of pairs of samples batched together in ``order_b`` that were together in ``order_a``.

    Label mix can't see it, but block shuffling keeps a block's samples in the same few batches
    every epoch when windows are small; a uniform shuffle gives about ``batch_size / N``.
    """
    a, b = np.asarray(order_a, dtype=np.int64), np.asarray(order_b, dtype=np.int64)
    n = max(int(a.max()), int(b.max())) + 1
    nbatch = min(len(a), len(b)) // batch_size
    batch_a = np.full(n, -1, dtype=np.int64)
    batch_a[a[: nbatch * batch_size]] = np.arange(nbatch * batch_size) // batch_size
    ids_b = b[: nbatch * batch_size]
    prev = batch_a[ids_b]
    keep = prev >= 0
    pair_key = (np.arange(nbatch * batch_size) // batch_size)[keep] * (nbatch + 1) + prev[keep]
    _, counts = np.unique(pair_key, return_counts=True)
    together = float(np.sum(counts * (counts - 1) // 2))
    return together / max(nbatch * batch_size * (batch_size - 1) / 2, 1.0)
