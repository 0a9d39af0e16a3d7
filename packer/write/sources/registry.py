"""Choosing a source by what SRC is, or by ``--source-type``; the one entry point ``scan_source``.

``SOURCES`` is checked in order: the first whose ``claims(path)`` is true reads SRC. A new source
is one module and one line here.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packer.errors import InputNotFoundError, OptionError, PackerError, arg
from packer.layout.manifest import MANIFEST_NAME
from packer.layout.trust import check_class_name
from packer.storage.url import Location, UrlPath, is_url, parse
from packer.write.sources.archive import ArchiveSource
from packer.write.sources.base import SourceOptions
from packer.write.sources.folder import FolderSource
from packer.write.sources.hf import HFSource
from packer.write.sources.listfile import LIST_SUFFIXES, ListSource
from packer.write.sources.mxrec import RecordIOSource
from packer.write.sources.packed import PackedSource
from packer.write.sources.records import ClassMapper, ScanResult, Source
from packer.write.sources.remote import RemoteFolderSource, list_prefix
from packer.write.sources.select import select
from packer.write.sources.spool import SPOOLED_TYPES, SpooledSource, holds_files, is_spooled
from packer.write.sources.webdataset import WebDatasetSource

SOURCES: dict[str, type[Source]] = {
    PackedSource.type: PackedSource,  # before folder: a dataset is a folder too
    WebDatasetSource.type: WebDatasetSource,  # before folder: a folder of .tar shards; a brace pattern
    HFSource.type: HFSource,  # before folder: a save_to_disk folder, a folder of .parquet files
    RecordIOSource.type: RecordIOSource,
    FolderSource.type: FolderSource,
    ListSource.type: ListSource,
    ArchiveSource.type: ArchiveSource,
}


def open_source(src: str | os.PathLike, options: SourceOptions = SourceOptions(),
                storage_options: Mapping[str, Any] | None = None) -> Source:
    """The source that reads ``src``: ``options.type`` when given, else the first of ``SOURCES`` that claims it;
    ``storage_options``: the object store's settings for whatever it reads at a URL (never recorded)."""
    if is_url(src):  # a file:// URL is a local path; any other, the object-storage sources
        location = parse(src)
        if not location.is_local:
            return open_url(location, options, storage_options)
        src = location.path
    path = Path(os.path.abspath(src))
    if options.type is not None:
        cls = SOURCES.get(options.type)
        if cls is None:
            raise OptionError(f"{arg('source_type', options.type)}: unknown (choose from {', '.join(SOURCES)})")
        return cls(path, options, storage_options=storage_options)
    for cls in SOURCES.values():  # a WebDataset brace pattern names no existing path
        if cls.claims(path):
            return cls(path, options, storage_options=storage_options)
    if not os.path.lexists(path):
        raise InputNotFoundError(f"{src}: no such folder or file")
    raise PackerError(f"{src}: not a source packer reads (a folder of images, a packer dataset, a list file "
                      ".csv/.tsv/.txt/.lst, an archive .tar/.tar.gz/.tgz/.zip, WebDataset shards "
                      "'shards-{000000..000009}.tar', a Hugging Face dataset (save_to_disk folder, .parquet) or an "
                      f"MXNet .rec); name its kind with {arg('source_type')}")


def open_url(location: Location, options: SourceOptions, storage_options: Mapping[str, Any] | None = None) -> Source:
    """The source reading ``location``, a URL: a list file, files read whole (archives, WebDataset shards, Parquet:
    write/sources/spool.py) or a prefix, of such files or laid out as ImageFolder (write/sources/remote.py)."""
    kind, path = options.type, UrlPath(str(location))
    if kind == "list" or kind is None and posixpath.splitext(location.key)[1].lower() in LIST_SUFFIXES:
        return ListSource(path, options, location, storage_options)
    if kind == "recordio" and not location.key.lower().endswith(".rec"):
        raise PackerError(f"{location}: {arg('source_type', kind)} reads one MXNet .rec object (its .idx beside it, "
                          "when there): name the .rec, e.g. s3://bucket/data/train.rec")
    if kind in SPOOLED_TYPES or kind is None and is_spooled(location):
        return SpooledSource(path, options, location, open_source, storage_options)
    if kind not in (None, "folder"):
        raise PackerError(f"{location}: {arg('source_type', kind)} is not read from object storage yet "
                          "(docs/sources.md lists the kinds that are)")
    listed = list_prefix(location, storage_options)
    if kind is None and (holds_files(list(listed)) or MANIFEST_NAME in listed):  # files read whole; a packer dataset
        return SpooledSource(path, options, location, open_source, storage_options)
    return RemoteFolderSource(path, options, location, listed, storage_options)


def scan_source(src: str | os.PathLike, options: SourceOptions = SourceOptions(),
                map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
                allow_empty: bool = False) -> ScanResult:
    """The records of ``src`` as ``options`` read and select them (``--classes``, ``--split``); ``skip_hidden``
    and ``allow_empty``: the folder rules (``write.scan.scan_folder``), for sources that are folders."""
    return scan_opened(open_source(src, options), map_classes, skip_hidden=skip_hidden, allow_empty=allow_empty)


def scan_opened(source: Source, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
                allow_empty: bool = False) -> ScanResult:
    """``scan_source`` of a source already opened (``open_source``): asked first, e.g. whether it is sequential."""
    src, options = source.path, source.options
    scan = source.scan(map_classes, skip_hidden=skip_hidden, allow_empty=allow_empty)
    scan.source_type = source.local().type if isinstance(source, SpooledSource) else source.type
    for k, name in enumerate(scan.classes):  # packer extract makes a folder of each: refused now, not then
        check_class_name(name, f"{src}: class {k}")
    return select(scan, options)
