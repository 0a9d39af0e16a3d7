# The compiled region decoder (_jpegregion.c); packer.images.jpegregion is its Python face.
import numpy as np

LIBJPEG_VERSION: int

def decode_region(data: bytes | memoryview, denom: int, top: int, left: int, out: np.ndarray, strict: bool,
                  max_pixels: int, whole: bool = False, /) -> bool: ...
