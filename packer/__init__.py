"""packer: pack loose image folders into few large files and read them back fast in PyTorch."""

__version__ = "0.1.0"

from packer.diagnose.instrument import instrument  # noqa: E402
from packer.diagnose.profile import profile  # noqa: E402
from packer.errors import PackerError  # noqa: E402
from packer.formats import FORMATS  # noqa: E402
from packer.read.cache import CachedDataset  # noqa: E402
from packer.read.dataset import DATASET_CLASSES, PackedDataset, open_dataset  # noqa: E402
from packer.read.loaders import BackgroundLoader, CUDAPrefetcher  # noqa: E402
from packer.read.sampler import BlockBatchSampler, BlockShuffleSampler, block_order  # noqa: E402
from packer.write.convert import ConvertResult, convert  # noqa: E402

globals().update({cls.__name__: cls for cls in DATASET_CLASSES.values()})

__all__ = [
    "__version__", "convert", "ConvertResult", "open_dataset", "PackedDataset", "PackerError", "FORMATS",
    "CachedDataset", "instrument", "profile", "BackgroundLoader", "CUDAPrefetcher",
    "BlockShuffleSampler", "BlockBatchSampler", "block_order",
    *(cls.__name__ for cls in DATASET_CLASSES.values()),
]
