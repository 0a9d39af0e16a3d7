"""Which rank this process is, decided when a sampler is used rather than when it is built.

Lightning (``strategy="ddp"``) and accelerate initialise ``torch.distributed`` inside ``fit`` or
``Accelerator()``, often after the user has built the DataLoader and its sampler: a sampler that
read the process group in its constructor would see none there and give every rank everything.
"""

from __future__ import annotations

import sys
import warnings

import torch.distributed as dist

from packer.errors import OptionError


def check_rank(rank: int, num_replicas: int) -> None:
    """A PackerError unless ``0 <= rank < num_replicas``."""
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise OptionError(f"rank {rank} is not in [0, {num_replicas}) ranks")


def replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``: each as given, else the initialised process group's, else one process."""
    grouped = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if grouped else 1
    if rank is None:
        rank = dist.get_rank() if grouped else 0
    check_rank(rank, num_replicas)
    return num_replicas, rank


def warn_if_accelerate(num_replicas: int) -> None:
    """Warn when a sampler splits ranks by itself in a process that has imported accelerate.

    ``accelerator.prepare(loader)`` deals a loader's batches out to the processes itself, so a
    sampler that already gave each rank its share would leave each process half of it (with 2).
    """
    if num_replicas > 1 and "accelerate" in sys.modules:
        warnings.warn(
            f"BlockShuffleSampler splits the samples over {num_replicas} ranks, and accelerate is loaded: "
            "accelerator.prepare(loader) splits them again. For a prepared loader build the sampler with "
            "num_replicas=1, rank=0; pass num_replicas and rank explicitly to silence this warning",
            stacklevel=3)
