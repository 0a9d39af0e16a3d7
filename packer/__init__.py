"""packer: pack loose image folders into few large files and read them back fast in PyTorch.

The public names load lazily (module ``__getattr__``), so ``packer --help`` and ``packer info``
start without importing torch. Type checkers read the same names from the ``TYPE_CHECKING`` imports
below (a test checks that the two lists agree).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from packer._version import __version__ as __version__

if TYPE_CHECKING:  # what a type checker sees; at run time the names below load on first use (_PUBLIC)
    from packer import dali as dali
    from packer.diagnose.instrument import instrument as instrument
    from packer.diagnose.profile import profile as profile
    from packer.errors import DatasetError as DatasetError
    from packer.errors import IndexingWarning as IndexingWarning
    from packer.errors import InputNotFoundError as InputNotFoundError
    from packer.errors import MissingPackageError as MissingPackageError
    from packer.errors import NotPackedError as NotPackedError
    from packer.errors import OptionError as OptionError
    from packer.errors import OutputExistsError as OutputExistsError
    from packer.errors import PackerError as PackerError
    from packer.errors import ResumableError as ResumableError
    from packer.errors import RunError as RunError
    from packer.errors import SharedCacheWarning as SharedCacheWarning
    from packer.formats import FORMATS as FORMATS
    from packer.images.crop import CenterCropDecode as CenterCropDecode
    from packer.images.crop import RandomResizedCropDecode as RandomResizedCropDecode
    from packer.read.collate import collate as collate
    from packer.read.dataset import DATASET_CLASSES as DATASET_CLASSES
    from packer.read.dataset import BMPDataset as BMPDataset
    from packer.read.dataset import CachedDataset as CachedDataset
    from packer.read.dataset import HDF5Dataset as HDF5Dataset
    from packer.read.dataset import LMDBDataset as LMDBDataset
    from packer.read.dataset import MemmapDataset as MemmapDataset
    from packer.read.dataset import MosaicDataset as MosaicDataset
    from packer.read.dataset import N5Dataset as N5Dataset
    from packer.read.dataset import PackedDataset as PackedDataset
    from packer.read.dataset import PthDataset as PthDataset
    from packer.read.dataset import RecordIODataset as RecordIODataset
    from packer.read.dataset import SafetensorsDataset as SafetensorsDataset
    from packer.read.dataset import open_dataset as open_dataset
    from packer.read.loaders import BackgroundLoader as BackgroundLoader
    from packer.read.loaders import CUDAPrefetcher as CUDAPrefetcher
    from packer.read.sampler import BlockBatchSampler as BlockBatchSampler
    from packer.read.sampler import BlockShuffleSampler as BlockShuffleSampler
    from packer.read.sampler import block_order as block_order
    from packer.read.threaded import ThreadLoader as ThreadLoader
    from packer.write.convert import ConvertResult as ConvertResult
    from packer.write.convert import convert as convert
    from packer.write.convert import export_wds as export_wds
    from packer.write.writer import Writer as Writer

# public name -> the module that defines it
_PUBLIC = {
    "convert": "packer.write.convert", "ConvertResult": "packer.write.convert", "Writer": "packer.write.writer",
    "export_wds": "packer.write.convert",
    "open_dataset": "packer.read.dataset", "PackedDataset": "packer.read.dataset",
    "DATASET_CLASSES": "packer.read.dataset", "CachedDataset": "packer.read.dataset",
    # the built-in formats' dataset classes: PackedDataset opening one format only
    **{name: "packer.read.dataset" for name in ("BMPDataset", "HDF5Dataset", "LMDBDataset", "MemmapDataset",
                                                "MosaicDataset", "N5Dataset", "PthDataset", "RecordIODataset",
                                                "SafetensorsDataset")},
    "PackerError": "packer.errors", "InputNotFoundError": "packer.errors", "OutputExistsError": "packer.errors",
    "OptionError": "packer.errors", "DatasetError": "packer.errors", "MissingPackageError": "packer.errors",
    "RunError": "packer.errors", "ResumableError": "packer.errors", "NotPackedError": "packer.errors",
    "IndexingWarning": "packer.errors", "SharedCacheWarning": "packer.errors",
    "FORMATS": "packer.formats",
    "instrument": "packer.diagnose.instrument", "profile": "packer.diagnose.profile",
    "BackgroundLoader": "packer.read.loaders", "CUDAPrefetcher": "packer.read.loaders",
    "ThreadLoader": "packer.read.threaded",
    "BlockShuffleSampler": "packer.read.sampler", "BlockBatchSampler": "packer.read.sampler",
    "block_order": "packer.read.sampler",
    "collate": "packer.read.collate",
    "RandomResizedCropDecode": "packer.images.crop", "CenterCropDecode": "packer.images.crop",
}
_SUBMODULES = {"dali"}  # packer.dali: DALI pipelines (NVIDIA DALI only imported when one is built)


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return ["__version__", *_PUBLIC]
    if name in _SUBMODULES:
        return importlib.import_module(f"packer.{name}")  # the import binds it as this package's attribute
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'packer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | _SUBMODULES)
