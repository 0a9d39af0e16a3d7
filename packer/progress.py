"""Progress bars, decided in one place: every long call (``convert``, ``export_wds``, ``verify``, ``extract``,
``make_sample``, ``CachedDataset``, ``packer.profile``) takes ``progress=`` and draws its bar through ``bar``.

``progress=None`` (the default): a bar only when stderr is a terminal, so logs, CI output and notebooks'
captured streams get none. ``True`` asks for one anyway, ``False`` never draws one. ``TQDM_DISABLE`` set to a
true value (``1``, ``true``, ``yes``) turns every bar off, asked for or not, as it does tqdm's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from typing import IO, Any

_FALSE = ("", "0", "false", "no", "off")


def progress_wanted(progress: bool | None, stream: IO[str] | None = None) -> bool:
    """Whether a long call given ``progress`` draws a bar on ``stream`` (default: stderr)."""
    if os.environ.get("TQDM_DISABLE", "").strip().lower() not in _FALSE:
        return False
    if progress is not None:
        return bool(progress)
    stream = sys.stderr if stream is None else stream
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str | None = None, unit: str = "img",
        progress: bool | None = None, **options: Any) -> Any:
    """A tqdm bar on stderr, drawn as ``progress_wanted(progress)`` decides (a disabled bar costs nothing)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not progress_wanted(progress), file=sys.stderr,
                dynamic_ncols=True, **options)
