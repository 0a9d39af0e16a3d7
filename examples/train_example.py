"""A small training loop that profiles its own input pipeline and says what limits it.

    packer sample demo/imgs --count 2000 --classes 10
    packer convert demo/imgs --to lmdb
    python examples/train_example.py demo/imgs.lmdb --epochs 1 --workers 2

A tiny CNN trains on 64x64 random crops (on the GPU when there is one, else the CPU). The
dataset is wrapped with ``packer.diagnose.instrument`` so the workers report read / decode / transform /
collate time per sample; the loop runs through ``packer.profile`` (wait for batch vs step) and
``CUDAPrefetcher`` (copies the next batch to the GPU during the current step; a pass-through on
CPU), optionally behind a ``BackgroundLoader`` thread (``--background N``); at the end it prints
the profile and the verdict: input-bound or compute-bound, and which stage to fix.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

import packer
from packer.diagnose.sweep import RandomCrop
from packer.diagnose.system import usable_cores
from packer.read.loaders import BackgroundLoader, CUDAPrefetcher


def tiny_cnn(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset", help="a packed dataset, e.g. demo/imgs.lmdb")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--crop", type=int, default=64)
    ap.add_argument("--cache", choices=("ram", "ram-decoded"), default=None,
                    help="serve samples from a shared RAM cache")
    ap.add_argument("--background", type=int, default=0, metavar="N",
                    help="keep N batches ready in a background thread "
                    "(packer.BackgroundLoader; useful with --workers 0)")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ds = packer.open_dataset(args.dataset, image="tensor", transform=RandomCrop(args.crop), cache=args.cache)
    ids = packer.instrument(ds)
    loader = DataLoader(ids, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                        pin_memory=device.type == "cuda", collate_fn=ids.collate(), drop_last=True,
                        persistent_workers=args.workers > 0)
    model = tiny_cnn(max(len(ds.classes), 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        source = BackgroundLoader(loader, depth=args.background) if args.background else loader
        prof = packer.profile(CUDAPrefetcher(source, device), desc=f"epoch {epoch}")
        total, correct, loss_sum = 0, 0, 0.0
        for x, y in prof:
            x = x.float().div_(255)
            out = model(x)
            loss = loss_fn(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(y)  # .item() waits for the GPU: the step's true time is counted
            correct += int((out.argmax(1) == y).sum())
            total += len(y)
        print(f"epoch {epoch}: loss {loss_sum / max(total, 1):.3f}, train accuracy {correct / max(total, 1):.1%}")
        print(prof.summary())
        print(prof.verdict(cores=usable_cores()))
    if hasattr(ds, "close"):
        ds.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
