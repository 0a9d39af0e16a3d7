"""The optional compiled parts: packer.images._jpegregion (JPEG region decode through libjpeg, docs/decoding.md) and
packer.formats._safecopy (copies out of a mapped shard that a truncation turns into an error, not a SIGBUS).

``optional=True``: without a compiler, or without libjpeg's headers (Debian: libjpeg62-turbo-dev), the
extension is skipped with a warning and ``pip install`` still succeeds; packer then crops after a whole decode
(and ThreadLoader copies payloads with ``pread``, slower on warm data). A wheel built so holds no compiled code and
is tagged as such (py3-none-any), not for this platform.
Everything else is declared in pyproject.toml.
"""

from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel


class bdist_wheel_as_built(bdist_wheel):
    """A wheel tagged by what it holds: platform-specific with the compiled extension, pure Python without it."""

    def get_tag(self) -> tuple[str, str, str]:
        built = (Path(self.bdist_dir) / "packer" / "images" / f"_jpegregion{suffix}" for suffix in EXTENSION_SUFFIXES)
        if not any(path.exists() for path in built):
            self.root_is_pure = True  # also the WHEEL file's Root-Is-Purelib, written after this
        return super().get_tag()


setup(ext_modules=[Extension("packer.images._jpegregion", ["packer/images/_jpegregion.c"], libraries=["jpeg"],
                             optional=True),
                   # copies out of mapped shards that survive a truncation (packer/formats/safecopy.py); libc only
                   Extension("packer.formats._safecopy", ["packer/formats/_safecopy.c"], optional=True)],
      cmdclass={"bdist_wheel": bdist_wheel_as_built})
