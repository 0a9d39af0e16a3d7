"""Several datasets read through one DataLoader, so that one spawn start (an interpreter per worker) checks them all
(tests/formats/test_contract.py: every format and payload under spawn)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from torch.utils.data import Dataset


class Cases(Dataset):
    """The samples of ``datasets`` one after another; sample k is ``(case, *datasets[case][j])``. Batches go to each
    dataset's own ``__getitems__`` (the batch path DataLoader workers take), a call per dataset a batch touches."""

    def __init__(self, datasets: Sequence):
        self.datasets = list(datasets)
        self.starts = [0]
        for ds in self.datasets:
            self.starts.append(self.starts[-1] + len(ds))

    def __len__(self) -> int:
        return self.starts[-1]

    def _where(self, k: int) -> tuple[int, int]:
        case = bisect_right(self.starts, k) - 1
        return case, k - self.starts[case]

    def __getitem__(self, k: int) -> tuple:
        return self.__getitems__([k])[0]

    def __getitems__(self, ks: Sequence[int]) -> list[tuple]:
        located = [self._where(k) for k in ks]
        read: dict[int, list] = {}
        for case in dict.fromkeys(c for c, _ in located):
            read[case] = list(self.datasets[case].__getitems__([j for c, j in located if c == case]))
        out = []
        for case, _ in located:
            out.append((case, *read[case].pop(0)))
        return out
