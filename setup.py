"""The optional compiled parts: packer.images._jpegregion (JPEG region decode through libjpeg, docs/decoding.md) and
packer.formats._safecopy (copies out of a mapped shard that a truncation turns into an error, not a SIGBUS).

``optional=True``: without a compiler, or without libjpeg's headers (Debian: libjpeg62-turbo-dev), the
extension is skipped with a warning and ``pip install`` still succeeds; packer then crops after a whole decode
(and ThreadLoader copies payloads with ``pread``, slower on warm data).
Everything else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("packer.images._jpegregion", ["packer/images/_jpegregion.c"], libraries=["jpeg"],
                             optional=True),
                   # copies out of mapped shards that survive a truncation (packer/formats/safecopy.py); libc only
                   Extension("packer.formats._safecopy", ["packer/formats/_safecopy.c"], optional=True)])
