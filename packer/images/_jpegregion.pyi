# The compiled region decoder (_jpegregion.c); packer.images.jpegregion is its Python face.
from collections.abc import Sequence

import numpy as np

LIBJPEG_VERSION: int

def decode_region(data: bytes | memoryview, denom: int, top: int, left: int, out: np.ndarray, strict: bool,
                  max_pixels: int, whole: bool = False, /) -> bool: ...
def decode_many(datas: Sequence[bytes | memoryview], outs: Sequence[np.ndarray], strict: bool, max_pixels: int,
                regions: np.ndarray | None = None, /) -> bytes: ...
def restart_transcode(data: bytes | memoryview, max_pixels: int, /) -> bytes | None: ...
