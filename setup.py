"""The optional compiled part: packer.images._jpegregion (JPEG region decode through libjpeg, docs/decoding.md).

``optional=True``: without a compiler, or without libjpeg's headers (Debian: libjpeg62-turbo-dev), the
extension is skipped with a warning and ``pip install`` still succeeds; packer then crops after a whole decode.
Everything else is declared in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("packer.images._jpegregion", ["packer/images/_jpegregion.c"], libraries=["jpeg"],
                             optional=True)])
