"""Is an existing output up to date? ``convert(..., if_changed=True)`` reuses a dataset whose manifest records
the same options and the same source: its file list, labels, sizes and modification times (one ``stat`` per
file, no reading), so re-running a pipeline (``make demo``) costs a scan, not a conversion.
"""

from __future__ import annotations

import hashlib
import os

from packer.errors import PackerError
from packer.write.journal import scan_digest
from packer.write.options import ConvertOptions
from packer.write.output import Output
from packer.write.sources.records import ScanResult
from packer.write.sources.remote import RemoteReader


def source_digest(scan: ScanResult) -> str:
    """Identifies what a conversion of ``scan`` reads: classes, paths, labels, what the scan could not follow,
    and each file's size and mtime (a file that can't be stat'ed by its error)."""
    h = hashlib.sha256(scan_digest(scan).encode())
    for e in scan.errors:
        h.update(f"{e.path}\0{e.reason}\n".encode("utf-8", "surrogateescape"))
    reader = scan.source_reader()
    if isinstance(reader, RemoteReader):  # objects: their size and ETag as listed (the reader's facts), no request
        for i, rel in enumerate(scan.rel_paths):
            h.update(f"{reader.facts(rel, scan.loc(i))}\n".encode())
        return h.hexdigest()
    root = os.fspath(scan.root)
    for rel in scan.rel_paths:
        try:
            st = os.stat(os.path.join(root, rel))  # not pathlib: one stat per file, before the work starts
            h.update(f"{st.st_size} {st.st_mtime_ns}\n".encode())
        except OSError as exc:
            h.update(f"{exc.errno}\n".encode())
    return h.hexdigest()


def stale_reason(out: Output, options: ConvertOptions, digest: str, sources_too: bool = True) -> str | None:
    """None when the dataset at ``out`` (a folder, or a prefix in a bucket) holds a conversion with exactly
    ``options`` of a source with ``digest`` (and its files are all there, at their recorded sizes); else why it
    must be converted again. ``sources_too=False``: the options and files only (a source that records no
    fingerprint can't be compared)."""
    try:
        manifest, _, problems = out.finished()
    except PackerError as exc:
        return f"it does not open: {exc}"
    if problems:
        return f"it does not open: {problems[0]}"
    recorded = options.record()
    changed = sorted(k for k in recorded.keys() | manifest.options.keys()
                     if recorded.get(k) != manifest.options.get(k))
    if changed:
        return "other options: " + ", ".join(f"{k} {manifest.options.get(k)} -> {recorded.get(k)}" for k in changed)
    if not sources_too:
        return None
    if not manifest.source_digest:
        return "made by a packer that did not record its source's files"
    if manifest.source_digest != digest:
        return "the source's files changed (added, removed, renamed, resized or modified)"
    return None
