"""Integer labels and their classes: the one rule every source (and the ``Writer``) applies to a label.

A label names class ``label`` of the named classes (``--classes-file``, a Parquet ``ClassLabel``), or,
without names, class ``"label"`` of ``"0"``..``"max"``. Checked per record, before the value goes into
any array or class list: a negative, non-integer or too-large label is an error for its record
(errors.json, with where the record is), never a renumbering, an overflow or a class list built up to
a huge value (a single ``100000000`` once made 100 million class names). Without names a label must
lie below ``MAX_IMPLICIT_CLASSES``: larger ones need their classes named.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from packer.errors import PackerError
from packer.layout.trust import check_class_name, check_inner_name
from packer.storage.url import is_url, parse
from packer.write.sources.base import read_list_text
from packer.write.sources.remote import read_text_object

MAX_IMPLICIT_CLASSES = 1 << 20  # without named classes, labels name "0".."max": a larger label is a mistake
_INTEGER = re.compile(r"-?[0-9]+")  # ASCII digits only ("²".isdigit() is true, int("²") fails)
_SHOWN = 40  # characters of a label an error message shows


def shown(text: str) -> str:
    """A label's text for a message: a very long one cut, with its length."""
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN - 4]}... ({len(text)} characters)"


def label_problem(value: int, named: int | None, hint: str = "give --classes-file", text: str | None = None
                  ) -> str | None:
    """Why the integer ``value`` names no class (None: it names one). ``named``: how many classes are named,
    None when they are "0".."max"; ``hint``: how to name classes (the Writer says ``classes=``); ``text``: the
    label as written, when it is shown instead of ``value``."""
    if text is None:  # str() of an int of more than 4300 digits raises
        text = str(value) if value.bit_length() <= 1000 else f"of {value.bit_length()} bits"
    label = shown(text)
    if value < 0:
        return f"label {label}: negative, not a class index"
    if named is not None:
        return None if value < named else f"label {label} is not one of the {named} classes (0..{named - 1})"
    if value >= MAX_IMPLICIT_CLASSES:
        return f"label {label} above {MAX_IMPLICIT_CLASSES - 1:,}: {hint} to name its classes"
    return None


def is_integer_text(text: str | bytes) -> bool:
    """Whether ``text`` (stripped) is an ASCII integer, sign included: what ``parse_label`` reads as a number."""
    body = text.decode("ascii", "replace") if isinstance(text, bytes) else text
    return _INTEGER.fullmatch(body.strip()) is not None


def parse_label(text: str | bytes, named: int | None) -> int | str:
    """The class index an integer label written as text stands for, or why it stands for none (``label_problem``).

    A label of more than 18 digits is judged by its length, never converted (``int()`` of a million digits
    is slow, then refused): no class count comes near it.
    """
    body = (text.decode("ascii", "replace") if isinstance(text, bytes) else text).strip()
    if not body:
        return "empty label"
    if _INTEGER.fullmatch(body) is None:
        return f"label {shown(body)!r}: not an integer"
    if len(body.lstrip("-").lstrip("0")) > 18:
        huge = -1 if body.startswith("-") else 1 << 62  # beyond any class count: a problem whatever the classes
        return label_problem(huge, named, text=body) or f"label {shown(body)}: not a class index"
    value = int(body)
    return label_problem(value, named) or value


def integer_classes(labels: Iterable[int], named: list[str] | None) -> list[str]:
    """The classes of labels checked by ``label_problem``: ``named``, else "0".."max" (none without a label >= 0)."""
    if named is not None:
        return named
    top = max((v for v in labels if 0 <= v < MAX_IMPLICIT_CLASSES), default=-1)
    return [str(i) for i in range(top + 1)]


def read_classes(path: Path | str, text: str | None = None) -> list[str]:
    """``--classes-file``: one class name per line (line i names label i), distinct, each a plain folder name
    (``packer extract`` makes one folder per class); ``text``: its text when already read (an object), ``path``
    then only naming it."""
    names = [n.strip() for n in (read_list_text(Path(path)) if text is None else text).splitlines()]
    while names and not names[-1]:
        names.pop()
    if not names or "" in names or len(set(names)) != len(names):
        raise PackerError(f"{path}: a classes file holds one distinct, non-empty class name per line")
    for line, name in enumerate(names, start=1):
        check_class_name(name, f"{path} line {line}")
    return names


def named_classes(classes_file: str | None, storage_options: Mapping[str, Any] | None = None) -> list[str] | None:
    """The classes ``--classes-file`` names, or None when it is not given; at a URL (``s3://...``), the object read
    with ``storage_options`` (one GET of the version its HEAD saw, the list files' size limit)."""
    if not classes_file:
        return None
    if is_url(classes_file) and not parse(classes_file).is_local:
        at = parse(classes_file)
        return read_classes(str(at), read_text_object(at, storage_options))
    return read_classes(parse(classes_file).path if is_url(classes_file) else Path(classes_file))


def inside_root(path: str, where: str) -> str:
    """``path`` when it is a plain relative path (read below ``--root``), else a PackerError naming ``where``."""
    return check_inner_name(path, f"{where}: image path")
