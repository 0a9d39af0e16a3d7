"""Distributed training jobs the tests run as real processes (Lightning DDP, torchrun, accelerate).

``python ddp_jobs.py KIND DATASET BLOCK_BYTES OUT``: each rank writes ``OUT/KIND-SAMPLER-rank{r}-epoch{e}.json``,
the sample indices it trained on in that epoch, in order. Every job builds its DataLoader and
sampler before the process group exists, as scripts usually do (``trainer.fit(model, loader)``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from packer import BlockShuffleSampler, open_dataset

EPOCHS = 2
BATCH = 8
SEED = 1


class Indexed(Dataset):
    """(index, label) of each sample, read through the packed dataset's real ``__getitems__``."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitems__(self, indices):
        return [(int(i), int(label)) for i, (_img, label) in zip(indices, self.ds.__getitems__(indices), strict=True)]

    def __getitem__(self, i):
        return self.__getitems__([i])[0]


def record(out: Path, name: str, rank: int, epoch: int, indices: list[int]) -> None:
    (out / f"{name}-rank{rank}-epoch{epoch}.json").write_text(json.dumps(indices))


def lightning_job(path: str, out: Path, block: int) -> None:
    import lightning as L

    ds = open_dataset(path, image="numpy")
    sampler = BlockShuffleSampler(ds, block_bytes=block, batch_size=BATCH, seed=SEED)
    loader = DataLoader(Indexed(ds), sampler=sampler, batch_size=BATCH)

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list[int] = []

        def training_step(self, batch, _i):
            self.seen += batch[0].tolist()
            return self.layer(batch[1].float()[:, None]).mean()

        def on_train_epoch_end(self):
            record(out, "lightning-block", self.global_rank, self.current_epoch, self.seen)
            self.seen = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = L.Trainer(strategy="ddp", devices=2, accelerator="cpu", max_epochs=EPOCHS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), loader)  # use_distributed_sampler=True, Lightning's default
    end_process_group()


def end_process_group() -> None:
    """Lightning and accelerate leave the group up at exit: Gloo's threads then die with the interpreter
    ("terminate called without an active exception", SIGABRT after the run finished: a flaky CI run; torch
    PR 179291 describes it). Training scripts should end the group themselves, as these jobs do."""
    if dist.is_initialized():
        dist.destroy_process_group()


def torchrun_job(path: str, out: Path, block: int) -> None:
    ds = open_dataset(path, image="numpy")
    samplers = {"block": BlockShuffleSampler(ds, block_bytes=block, batch_size=BATCH, seed=SEED)}
    dist.init_process_group("gloo")  # from torchrun's environment
    try:
        samplers["distributed"] = DistributedSampler(ds, seed=SEED)
        for name, sampler in samplers.items():
            loader = DataLoader(Indexed(ds), sampler=sampler, batch_size=BATCH)
            for epoch in range(EPOCHS):
                sampler.set_epoch(epoch)
                seen: list[int] = []
                for batch in loader:  # a collective per step, as DDP does: uneven batch counts would hang
                    dist.all_reduce(torch.tensor([len(batch[0])]))
                    seen += batch[0].tolist()
                record(out, f"torchrun-{name}", dist.get_rank(), epoch, seen)
    finally:
        dist.destroy_process_group()


def accelerate_job(path: str, out: Path, block: int) -> None:
    import warnings

    from accelerate import Accelerator

    ds = open_dataset(path, image="numpy")
    implicit = BlockShuffleSampler(ds, block_bytes=block, batch_size=BATCH, seed=SEED)  # ranks from the group
    # accelerate splits the batches itself: the sampler gives every process the whole order
    sampler = BlockShuffleSampler(ds, block_bytes=block, batch_size=BATCH, seed=SEED, num_replicas=1, rank=0)
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(Indexed(ds), sampler=sampler, batch_size=BATCH))
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        seen: list[int] = []
        for batch in loader:
            seen += batch[0].tolist()
        record(out, "accelerate-block", accelerator.process_index, epoch, seen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        list(accelerator.prepare(DataLoader(Indexed(ds), sampler=implicit, batch_size=BATCH)))
    (out / f"accelerate-warnings-rank{accelerator.process_index}.json").write_text(
        json.dumps([str(w.message) for w in caught]))
    end_process_group()


JOBS = {"lightning": lightning_job, "torchrun": torchrun_job, "accelerate": accelerate_job}

if __name__ == "__main__":
    kind, dataset, block_bytes, outdir = sys.argv[1:5]
    JOBS[kind](dataset, Path(outdir), int(block_bytes))
