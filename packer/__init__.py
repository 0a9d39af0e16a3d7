"""packer: pack loose image folders into few large files and read them back fast in PyTorch.

The public names load lazily (module ``__getattr__``), so ``packer --help`` and ``packer info``
start without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from packer._version import __version__ as __version__

# public name -> the module that defines it
_PUBLIC = {
    "convert": "packer.write.convert", "ConvertResult": "packer.write.convert", "Writer": "packer.write.writer",
    "export_wds": "packer.write.export_wds",
    "open_dataset": "packer.read.dataset", "PackedDataset": "packer.read.dataset",
    "DATASET_CLASSES": "packer.read.dataset",
    "PackerError": "packer.errors", "FORMATS": "packer.formats",
    "CachedDataset": "packer.read.cache",
    "instrument": "packer.diagnose.instrument", "profile": "packer.diagnose.profile",
    "BackgroundLoader": "packer.read.loaders", "CUDAPrefetcher": "packer.read.loaders",
    "ThreadLoader": "packer.read.threaded",
    "BlockShuffleSampler": "packer.read.sampler", "BlockBatchSampler": "packer.read.sampler",
    "block_order": "packer.read.sampler",
    "collate": "packer.read.collate",
    "RandomResizedCropDecode": "packer.images.crop", "CenterCropDecode": "packer.images.crop",
}
_SUBMODULES = {"dali"}  # packer.dali: DALI pipelines (NVIDIA DALI only imported when one is built)


def _dataset_class_names() -> list[str]:
    """The per-format dataset classes (LMDBDataset, ...): one per registered format."""
    from packer.formats import FORMATS

    return [fmt.dataset_class for fmt in FORMATS.values()]


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return ["__version__", *_PUBLIC, *_dataset_class_names()]
    if name in _SUBMODULES:
        return importlib.import_module(f"packer.{name}")  # the import binds it as this package's attribute
    module = _PUBLIC.get(name)
    if module is None and name.endswith("Dataset") and name in _dataset_class_names():
        module = "packer.read.dataset"
    if module is None:
        raise AttributeError(f"module 'packer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | _SUBMODULES | set(_dataset_class_names()))
