"""Staged reading, as code: a sample goes read -> decode -> present, a batch through ONE loop.

``StagedDataset`` is the contract ``PackedDataset`` and ``CachedDataset`` keep and that samplers, the
RAM cache and the profiler rely on; ``load_batch`` is the one batch loop (DataLoader's ``__getitems__``),
which ``packer.instrument`` runs with a ``StageClock`` instead of copying it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from packer.errors import PackerError
from packer.layout.index import normalize_index, normalize_indices
from packer.layout.manifest import IMAGELESS
from packer.read.collate import mark_mixed_shapes
from packer.read.hints import aheads_of

if TYPE_CHECKING:
    from packer.images.crop import CropDecode, Window
    from packer.layout.index import Index
    from packer.layout.manifest import Manifest
    from packer.read.hints import Ahead
    from packer.read.indexing import IndexMap
    from packer.read.readahead import Pending


BULK_CHUNK = 8  # samples decoded by one samples_in_slots call in a batch loop: few enough to start on early bytes


class StageClock(Protocol):
    """Receives a batch's seconds per stage (packer.instrument's per-process table)."""

    def add(self, read: float, decode: float, transform: float, samples: int) -> None: ...


class StagedDataset(Dataset, ABC):
    """A dataset of packer samples read in stages. Hooks with defaults: read-ahead, batch slots, blocks.

    Public indices are ImageFolder's (``index_map``, see packer.read.indexing); they are mapped to
    storage positions once, at the entry (``position``), and every hook named ``*_at`` as well as
    ``start_reads``, ``batch_slots``, ``block_boundaries`` and ``index`` work in storage positions.
    """

    index: Index  # per-sample metadata in storage order: labels, sizes, source paths
    manifest: Manifest
    index_map: IndexMap

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def payload_at(self, pos: int) -> Any:
        """The stored payload at storage position ``pos``: encoded bytes, or an HWC uint8 array."""

    @abstractmethod
    def pixels_at(self, pos: int, payload: Any = None, strict: bool = False, out: np.ndarray | None = None,
                  window: Window | None = None) -> np.ndarray:
        """The sample at ``pos`` as HWC uint8 RGB, decoded into ``out`` where given and of the right shape;
        a fused crop (``crop=``) with ``window`` where given (``crop_windows``), else one drawn for it now."""

    @abstractmethod
    def present_at(self, pos: int, arr: np.ndarray | None, tensor: torch.Tensor | None = None) -> Any:
        """(image as the dataset hands it out, target), transforms applied, plus any fields asked for
        (packer.read.fields); ``tensor`` holds ``arr`` already. ``arr`` None: a dataset without images."""

    def payloads_at(self, stored: Sequence[int] | np.ndarray, ahead: Sequence[Ahead] = (),
                    pending: Pending | None = None, into: Callable[[int], np.ndarray] | None = None,
                    places: Sequence[np.ndarray | None] | None = None) -> list:
        """Payloads at these storage positions, in the order given (``ahead``: as for ``start_reads``;
        ``pending``: what ``start_reads`` of the same positions returned earlier, instead of starting them now;
        ``into``: copies in memory of their own, read from the files and never through a map, in flat uint8
        memory ``into(nbytes)`` gives where they are plain bytes: what threads decode that a file truncated
        meanwhile must not kill with SIGBUS, ``packer.ThreadLoader``'s; ``places``: per sample, the flat batch
        slot its decoded pixels go to, where raw pixels may be read straight into; the default has no files)."""
        return [self.payload_at(int(p)) for p in stored]

    def check_index(self, i: int) -> int:
        """``i`` as a position in ``range(len(self))`` (negative from the end), else IndexError."""
        return normalize_index(i, len(self))

    def position(self, i: int) -> int:
        """Where sample ``i`` (a public index, negative from the end) is stored; IndexError out of range."""
        return self.index_map.stored(self.check_index(i))

    def positions(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.index_map.stored_many(normalize_indices(indices, len(self)))

    @property
    def indexing(self) -> str:
        """``"imagefolder"``: ``ds[i]`` is ImageFolder's sample i; ``"subset"``: some source records were not
        packed, ``ds[i]`` is ImageFolder's sample ``ds.imagefolder_index(i)``; ``"stored"``: the i-th stored sample
        (a dataset written before packer recorded the map). packer.read.indexing."""
        return self.index_map.kind

    def start_reads(self, idx: np.ndarray, ahead: Sequence[Ahead] = ()) -> Pending | None:
        """Start reading these storage positions' bytes in the background (``ahead``: the blocks the order being
        iterated reads, its indices' hints, packer.read.hints); None: nothing to read ahead."""
        return None

    def batch_slots(self, idx: Sequence[int]) -> list[torch.Tensor] | None:
        """Per sample (storage positions), a tensor in one shared block to decode into; None: each its own array."""
        return None

    def decode_block(self, idx: Sequence[int], alloc: Callable[[int], torch.Tensor] | None = None
                     ) -> tuple[torch.Tensor | None, list[torch.Tensor]] | None:
        """A batch to decode into in this process: (the stacked NHWC batch or None, one slot per sample);
        None: each sample its own array (``packer.ThreadLoader`` then collates)."""
        return None

    def samples_in_slots(self, idx: Sequence[int], payloads: Sequence, slots: Sequence[torch.Tensor],
                         windows: Sequence[Window] | None = None) -> list | None:
        """Samples at these storage positions as ``present_at`` hands them out, decoded straight into their slots
        in one call (fused crops with ``windows``), None for each it did not decode (decode those one by one);
        None: no such bulk path here."""
        return None

    def crop_windows(self, idx: Sequence[int]) -> list[Window] | None:
        """The fused crop's window of each sample at these storage positions, drawn now in this order (a batch's
        order, whatever order its samples are decoded in); None: no fused crop, or each sample draws its own."""
        return None

    def crop_stream(self) -> CropDecode | None:
        """The fused crop whose stream ``crop_windows`` draws from (None: no fused crop)."""
        return None

    def block_boundaries(self) -> np.ndarray | None:
        """Storage positions where the dataset's natural blocks start, then len(self); None: blocks by bytes."""
        return None

    def follow(self, stored: np.ndarray, indices: Iterator[int], start: int) -> Iterator[int]:
        """A sampler's pass over storage positions ``stored``, handed out from ``start`` as ``indices``: the
        dataset may follow it to fetch ahead (a remote dataset's shards); default ``indices`` as they are."""
        return indices

    @property
    def has_images(self) -> bool:
        """False for a dataset of samples without an image (a Writer's fields and labels alone, payload ``none``):
        nothing is read or decoded, and a sample is ``(fields, label)`` (packer.read.fields)."""
        return self.manifest.payload != IMAGELESS

    # ------------------------------------------------------------ the public surface: ImageFolder indices

    def __getitem__(self, i: int) -> Any:
        pos = self.position(i)
        if not self.has_images:
            return self.present_at(pos, None)
        return self.present_at(pos, self.pixels_at(pos, self.payload_at(pos)))

    def __getitems__(self, indices: Sequence[int]) -> list:
        return load_batch(self, indices)

    def read_payload(self, i: int) -> Any:
        """The stored payload of sample ``i``: encoded bytes, or raw pixel bytes/array."""
        return self.payload_at(self.position(i))

    def read_payloads(self, indices: Sequence[int] | np.ndarray) -> list:
        """Payloads of many samples, returned in the order asked (read in file order where the dataset can)."""
        return self.payloads_at(self.positions(indices), aheads_of(indices))

    def pixels(self, i: int, payload: Any = None, strict: bool = False, out: np.ndarray | None = None) -> np.ndarray:
        """Sample ``i`` as HWC uint8 RGB (``payload``: its stored payload, read already).

        ``strict``: a decoder warning (e.g. a truncated JPEG, which Pillow pads with grey) is an
        error too, as in conversion's full validation (``packer verify --deep`` uses it).
        """
        if not self.has_images:
            raise PackerError(f"{self.manifest.source or 'this dataset'}: its samples have no image (fields and "
                              "labels only: ds[i] is (fields, label))")
        return self.pixels_at(self.position(i), payload, strict, out)


def load_batch(ds: StagedDataset, indices: Sequence[int], clock: StageClock | None = None) -> list:
    """A batch's samples: its bytes read ahead in file order while this thread decodes them as their bytes come
    in (IO overlaps decoding), into one shared block where the dataset offers slots, there ``BULK_CHUNK`` at a time
    in one call where the dataset can (``samples_in_slots``: fewer Python layers per image)."""
    if not ds.has_images:  # fields and labels only: nothing to read or decode
        return mark_mixed_shapes([ds.present_at(p, None) for p in ds.positions(indices).tolist()])
    now = time.perf_counter
    t0 = now()
    idx = ds.positions(indices).tolist()
    pending = ds.start_reads(np.asarray(idx, dtype=np.int64), aheads_of(indices))
    slots = ds.batch_slots(idx)
    windows = ds.crop_windows(idx)  # in the batch's order: the crops do not depend on which bytes came first
    read, decode, transform = now() - t0, 0.0, 0.0
    if pending is None:
        positions, waits = list(range(len(idx))), None
    else:  # items in the order their bytes arrive, mapped back to their place in the batch
        file_order = sorted(range(len(idx)), key=idx.__getitem__)
        waits = pending.arrival_order()
        positions = [file_order[k] for k in waits]
    out: list = [None] * len(idx)
    step = 1 if slots is None else BULK_CHUNK
    for lo in range(0, len(positions), step):
        group = positions[lo:lo + step]
        a = now()
        if pending is not None and waits is not None:
            pending.wait(waits[lo + len(group) - 1])  # the last of the group to arrive
        payloads = [ds.payload_at(idx[j]) for j in group]
        b = now()
        bulk = None if slots is None else ds.samples_in_slots(
            [idx[j] for j in group], payloads, [slots[j] for j in group],
            None if windows is None else [windows[j] for j in group])
        c = now()
        read, decode = read + b - a, decode + c - b
        for k, j in enumerate(group):
            if bulk is not None and bulk[k] is not None:
                out[j] = bulk[k]
                continue
            c = now()
            arr, tensor = pixels_in_slot(ds, idx[j], payloads[k], None if slots is None else slots[j],
                                         None if windows is None else windows[j])
            d = now()
            out[j] = ds.present_at(idx[j], arr, tensor)
            decode, transform = decode + d - c, transform + now() - d
    if clock is not None:
        clock.add(read, decode, transform, len(out))
    return mark_mixed_shapes(out)  # torch's default collate then names packer.collate (read.collate)


def pixels_in_slot(ds: StagedDataset, i: int, payload: Any, slot: torch.Tensor | None, window: Window | None = None
                   ) -> tuple[np.ndarray | None, torch.Tensor | None]:
    """The pixels at storage position ``i`` (a fused crop's with ``window`` where given), decoded into ``slot`` when
    given: (pixels, the slot holding them, or None where it does not, e.g. no slot or a size other than the index's);
    a dataset without images has neither."""
    if not ds.has_images:
        return None, None
    if slot is None:
        return ds.pixels_at(i, payload, window=window), None
    view = slot.numpy()
    arr = ds.pixels_at(i, payload, out=view, window=window)
    return arr, slot if arr is view else None
