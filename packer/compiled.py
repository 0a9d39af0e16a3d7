"""packer's optional compiled extensions (setup.py builds them where it can): each imported once, here, and what is
missing said once per process, with what packer does instead and how to build it."""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass, field
from types import ModuleType

log = logging.getLogger(__name__)  # under "packer": the command line prints it, a library user routes it

BUILD = ("install packer again from its source checkout (pip install -e . there; a wheel built without them is "
         "py3-none-any)")


@dataclass
class Extension:
    """One optional extension: its module where it loaded, else why not (``missing``)."""

    name: str  # the module, e.g. packer.images._jpegregion
    what: str  # what it is, for the notice
    without: str  # what packer does without it
    needs: str  # what building it needs
    module: ModuleType | None = None
    missing: str | None = None  # why it did not load: the ImportError's first line
    _said: bool = field(default=False, repr=False)

    @property
    def available(self) -> bool:
        return self.module is not None

    def notice(self) -> None:
        """Say once per process that the extension is missing, what packer does instead and how to build it;
        nothing where it loaded."""
        with _lock:
            if self.module is not None or self._said:
                return
            self._said = True
        log.warning("%s is not built (%s); %s. Build it: %s, then %s", self.what, self.missing, self.without,
                    self.needs, BUILD)


_lock = threading.Lock()
_loaded: dict[str, Extension] = {}


def extension(name: str, what: str, without: str, needs: str) -> Extension:
    """The optional extension ``name``, imported on the first call in this process (the same record after)."""
    with _lock:
        ext = _loaded.get(name)
        if ext is None:
            ext = _loaded[name] = Extension(name, what, without, needs)
            try:
                ext.module = importlib.import_module(name)
            except ImportError as exc:  # not built: no compiler, or no headers, when packer was installed
                ext.missing = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return ext


def jpeg_region() -> Extension:
    """``packer.images._jpegregion``: JPEG region decode and restart rewrite through libjpeg (docs/decoding.md)."""
    return extension("packer.images._jpegregion", "the JPEG region decoder",
                     "crops decode the whole image, slower (docs/decoding.md)",
                     "apt-get install libjpeg62-turbo-dev (libjpeg's headers)")


def safe_copy() -> Extension:
    """``packer.formats._safecopy``: copies out of a mapped shard under a SIGBUS guard (docs/guarantees.md)."""
    return extension("packer.formats._safecopy", "the guarded map copy",
                     "ThreadLoader reads payloads with pread, slower on warm data (docs/guarantees.md)",
                     "a C compiler")
