"""The public ``Writer``: your own samples (encoded images or HWC arrays, a label, per-sample fields) into a dataset.

```python
with Writer("boxes.lmdb", format="lmdb", fields={"boxes": "float32[:,4]", "caption": "str"}) as w:
    w.add(image=jpeg_bytes, label=3, boxes=np.zeros((2, 4)), caption="a dog")
```

A sample may have no image (``image`` left out: tokens, embeddings, boxes only): the dataset then holds none
(payload ``"none"``, decided by the first sample or by ``payload="none"``; docs/fields.md).

The same files, checks and finish as ``convert``: each image validated (``validate``) and stored through the
format's ``ShardWriter`` (write.shards), shards journaled in ``<out>.partial`` (write.journal), and
index, fields, errors.json and the manifest written last before the swap into place (write.finish).
Samples are named by their number (``"000000007"``), stored in the order added. A shard's field values
are spooled beside its journal entry (``journal/shard-NNNNN.fields/``), so ``resume=True``, given the same
samples again in the same order, skips the journaled shards and keeps their fields.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from packer._version import __version__
from packer.errors import OptionError, OutputExistsError, PackerError
from packer.formats import get_format
from packer.formats.base import PreparedSample
from packer.layout.fields import FieldStore, encode_cell, parse_specs, save_fields
from packer.layout.fsutil import fsync_file
from packer.layout.manifest import IMAGELESS, Manifest
from packer.layout.partial import JOURNAL_DIR
from packer.layout.trust import check_class_name
from packer.storage.url import is_url, parse
from packer.write.finish import seal, stored_index
from packer.write.journal import (
    ShardResult,
    remove_unkept,
    shard_entry,
)
from packer.write.lock import OutputLock
from packer.write.options import ConvertOptions, make_options
from packer.write.output import Output, check_replaceable
from packer.write.plan import shard_multiple
from packer.write.remote_output import RemoteOutput
from packer.write.shards import ShardSink, make_payload
from packer.write.sources.labels import integer_classes, label_problem
from packer.write.sources.records import SourceError

WRITER_SHARD_BYTES = 256 << 20  # at most this much of a shard is held in memory before it is written
SOURCE_TYPE = "writer"  # the manifest's source_type: samples are named by number, not source paths


def _cell_bytes(cell: Any) -> int:
    """About how much of a shard's memory a field cell takes: what fills a shard of samples without images."""
    return int(cell.nbytes) if isinstance(cell, np.ndarray) else len(cell) if isinstance(cell, bytes) else 8


class Writer:
    """Writes your own samples into a new packer dataset at ``path``; use as a context manager.

    ``add`` one sample at a time, in the order they are to be stored; leaving the ``with`` block finishes the
    dataset (index, fields, errors.json, manifest) and moves it into place, as ``convert`` does.

    Args:
        path: the dataset directory to create.
        format: the format: ``lmdb`` (default), ``hdf5``, ``memmap``, ``bmp``, ``mosaic``, ``recordio``, ``n5``,
            ``pth`` or ``safetensors``.
        fields: per-sample fields beside the image and label: name -> spec (``int``, ``float``, ``str``, ``json``,
            ``bytes``, or an array such as ``float32[:,4]``; docs/fields.md).
        classes: the class names, label ``i`` being ``classes[i]`` (default: ``"0"`` .. the largest label).
        on_error: ``"raise"`` (default) a PackerError naming a sample that cannot be stored, or ``"skip"`` it
            into errors.json.
        resume: go on with an interrupted Writer's ``<path>.partial`` (a URL: its unfinished upload, from any
            machine): ``add`` the same samples again in the same order, the journaled shards are skipped (not
            written or uploaded again).
        overwrite: replace an existing packer dataset at ``path`` (anything else there is refused).
        storage_options: ``path`` a URL (``s3://``, ``gs://``, ``az://``): the storage client's settings
            (obstore's keys; default: the environment, ``~/.aws``, instance roles).
        staging_dir: ``path`` a URL: where each shard is written before its upload (deleted once uploaded;
            default: the system's temporary folder).
        **options: as for ``convert``: ``payload``, ``validate``, ``shard_bytes``, ``compression``, ``decoder``
            and the format's own; ``payload`` defaults to ``raw`` when the first image is an array (packer never
            encodes pixels). Samples are stored in the order added (``order="source"``).

    Raises:
        OutputExistsError: ``path`` holds something packer won't replace (a ``FileExistsError``).
        OptionError: an option out of its range (a ``ValueError``).
    """

    def __init__(self, path: str | os.PathLike, format: str = "lmdb", fields: dict[str, str] | None = None, *,
                 classes: Sequence[str] | None = None, on_error: str = "raise", resume: bool = False,
                 overwrite: bool = False, storage_options: dict[str, Any] | None = None,
                 staging_dir: str | os.PathLike | None = None, **options: Any) -> None:
        if is_url(path) and parse(path).is_local:  # file:///path: a local path
            path = parse(path).path
        if is_url(path):  # shards uploaded as they are finished, the manifest last (write.remote_output)
            self.output: Output = RemoteOutput(str(path), storage_options, staging_dir, overwrite=overwrite,
                                               resume=resume)
        else:
            self.output = Output(Path(os.path.abspath(path)))
        self.out = self.output.path  # the dataset's folder, or its staging folder for a URL
        self.name = self.output.shown  # the output as messages name it
        self.partial = self.output.folder
        self.fmt = get_format(format)
        self.specs = parse_specs(fields, "Writer fields")
        self.classes = None if classes is None else [str(c) for c in classes]
        if self.classes is not None and len(set(self.classes)) != len(self.classes):
            raise OptionError("Writer: class names repeat")
        for k, name in enumerate(self.classes or []):  # packer extract makes a folder of each
            check_class_name(name, f"Writer: classes[{k}]")
        if on_error not in ("skip", "raise"):
            raise OptionError(f"unknown error policy {on_error!r} (choose skip or raise)")
        if options.setdefault("order", "source") != "source":
            raise OptionError("Writer: samples are stored in the order added (order='source'); shuffle when adding")
        self.on_error, self.given = on_error, options
        self._make_options(b"").check()  # unknown or bad options fail now, not at the first sample (bytes: as default)
        if isinstance(self.output, RemoteOutput):
            self.output.check(self.output.shown, True)
            if self.output.complete() and not overwrite:  # resume=True over a finished dataset: as for a folder
                raise OutputExistsError(f"{self.name}: already exists (use overwrite=True to replace it)")
        else:
            check_replaceable(self.out, overwrite)
        self.opts: ConvertOptions | None = None
        self.count = 0  # samples offered so far
        self.done: list[ShardResult] = []  # shards written (journaled), in order
        self.skip = 0  # samples a resumed run finds in journaled shards
        self.complete = False  # a resumed run found the dataset finished, only its move into place left
        self.closed = False
        self._pending: list[PreparedSample | SourceError] = []
        self._cells: dict[str, list[Any]] = {k: [] for k in self.specs}
        self._bytes = self._stored = 0  # the pending samples' payload bytes, and how many will be stored
        self.lock: OutputLock | None = None  # on <out>.partial from its making (or finding) to the end
        if self.output.left_over():
            try:
                self._resume(resume)
            except BaseException:
                self._release()
                raise

    # ------------------------------------------------------------ adding

    def add(self, image: bytes | bytearray | memoryview | np.ndarray | None = None, label: int = -1,
            **fields: Any) -> None:
        """Add one sample: encoded image bytes (JPEG, PNG, ...), an HWC uint8 RGB array, or no image (None: a
        dataset of fields alone, as the first sample decides), its class index and every declared field. A bad
        sample raises a PackerError naming its number (``on_error="skip"``: listed in errors.json instead)."""
        if self.closed:
            raise PackerError(f"{self.name}: the Writer is closed")
        n = self.count
        if set(fields) != set(self.specs):
            missing, unknown = sorted(set(self.specs) - set(fields)), sorted(set(fields) - set(self.specs))
            raise PackerError(f"{self.name}: sample {n}: " + "; ".join(
                [f"missing field(s) {', '.join(missing)}"] * bool(missing)
                + [f"undeclared field(s) {', '.join(unknown)} (declare them in fields=)"] * bool(unknown)))
        self.count += 1
        if n < self.skip or self.complete:
            return  # a resumed run: this sample is in a journaled shard already
        key = f"{n:09d}"
        res, cells = self._prepare(key, image, label, fields)
        if isinstance(res, SourceError) and self.on_error == "raise":
            raise PackerError(f"{self.name}: sample {n}: {res.reason}")
        self._pending.append(res)
        if isinstance(res, PreparedSample):
            for name, cell in cells.items():
                self._cells[name].append(cell)
            self._bytes += res.nbytes if res.nbytes else sum(map(_cell_bytes, cells.values()))  # no image: the fields
            self._stored += 1
            opts = self._options_for(res.payload)
            if self._bytes >= (opts.shard_bytes or WRITER_SHARD_BYTES) and self._stored % shard_multiple(opts) == 0:
                self._flush()

    def _prepare(self, key: str, image: Any, label: Any, fields: dict[str, Any]
                 ) -> tuple[PreparedSample | SourceError, dict[str, Any]]:
        """The sample's payload and field cells, or a SourceError saying what is wrong with it."""
        try:
            cells = {name: encode_cell(spec, fields[name], f"field {name!r}") for name, spec in self.specs.items()}
        except PackerError as exc:
            return SourceError(key, str(exc)), {}
        if isinstance(label, (bool, np.bool_)) or not isinstance(label, (int, np.integer)):
            return SourceError(key, f"label {label!r}: expected a class index (an integer; -1: no class)"), {}
        why = None if label == -1 else label_problem(int(label), None if self.classes is None else len(self.classes),
                                                       hint="pass classes=")
        if why is not None:
            return SourceError(key, why), {}
        if image is None:
            if self._options_for(None).payload != IMAGELESS:
                return SourceError(key, "no image, but this dataset stores images (its first sample had one)"), {}
            return PreparedSample(-1, key, int(label), b"", 0, 0), cells
        if isinstance(image, np.ndarray):
            if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
                why = f"image array {image.dtype} {image.shape}: expected HWC uint8 RGB (H, W, 3)"
                return SourceError(key, why), {}
            if image.shape[0] == 0 or image.shape[1] == 0:
                return SourceError(key, f"image array {image.shape}: an empty image"), {}
            data: bytes | np.ndarray = image
        elif isinstance(image, (bytes, bytearray, memoryview)):
            data = bytes(image)
        else:
            return SourceError(key, f"image: expected encoded bytes or an HWC uint8 array, "
                                    f"found {type(image).__name__}"), {}
        opts = self._options_for(data)
        if opts.payload == IMAGELESS:
            return SourceError(key, "an image, but this dataset holds none (its first sample had none, or "
                                    "payload='none')"), {}
        if isinstance(data, np.ndarray) and opts.payload != "raw":
            raise OptionError(f"{self.name}: sample {key}: an array of pixels needs payload='raw' (this dataset "
                              "stores encoded images, and packer never encodes pixels)")
        return make_payload(key, int(label), data, None, opts), cells

    def _options_for(self, data: Any) -> ConvertOptions:
        """The options, made at the first sample (its kind decides the payload when none was given)."""
        if self.opts is None:
            opts = self._make_options(data)
            opts.check()
            opts.shard_bytes = opts.shard_bytes or min(self.fmt.default_shard_bytes or WRITER_SHARD_BYTES,
                                                       WRITER_SHARD_BYTES)
            self.opts = opts
            self._start()
        return self.opts

    def _make_options(self, data: Any) -> ConvertOptions:
        """Options from the keywords given; without ``payload``: raw for pixels (an array, or ``resize`` or
        ``compression``, which apply to pixels only), none for no image, else the format's default."""
        given = dict(self.given)
        if given.get("payload") is None and (isinstance(data, np.ndarray) or given.get("resize") is not None
                                             or given.get("compression") is not None):
            given["payload"] = "raw"
        elif given.get("payload") is None and data is None:
            given["payload"] = IMAGELESS
        return make_options(self.fmt.name, **given)

    # ------------------------------------------------------------ shards and journal

    def _plan(self) -> dict[str, Any]:
        assert self.opts is not None
        return {"writer": 1, "options": self.opts.record(), "fields": {k: s.text for k, s in self.specs.items()},
                "classes": self.classes, "source": SOURCE_TYPE}

    def _start(self) -> None:
        """Create ``<out>.partial`` with the plan, or check a resumed one's plan against these options."""
        if not self.output.left_over():
            self.lock = self.output.start(self._plan())
        elif self.output.plan() != self._plan():
            raise OutputExistsError(self.output.not_resumable("written with other options, fields or classes",
                                                              again="write again"))

    def _resume(self, resume: bool) -> None:
        """Go on with an interrupted Writer's ``<out>.partial``: its journaled shards count as written."""
        plan = self.output.plan()
        if plan is None:
            raise OutputExistsError(f"{self.partial}: exists but was not made by a packer Writer; move it away")
        self.output.check_free()  # a live run's is in use, not left over
        if plan.get("writer") != 1 and isinstance(self.output, RemoteOutput):
            raise OutputExistsError(self.output.not_resumable("not written by a packer Writer (a conversion's)",
                                                              again="write again"))
        if plan.get("writer") != 1:
            raise OutputExistsError(f"{self.partial}: exists but was not made by a packer Writer; move it away")
        if not resume:
            raise OutputExistsError(f"{self.partial}: left over from an interrupted Writer: pass resume=True and add "
                                    f"the same samples again in the same order, or remove it (rm -r '{self.partial}')")
        self.lock = self.output.take()
        if self.given.get("payload") is None:  # decided by the first sample of the interrupted run
            self.given["payload"] = plan.get("options", {}).get("payload")
        if self.output.swapping():
            self.complete = True
            return
        done: dict[int, ShardResult] = {}
        while shard_entry(self.partial, len(done)).is_file():
            entry = shard_entry(self.partial, len(done))
            result = ShardResult.from_json(entry.read_text(encoding="utf-8"), str(entry))
            if self.specs and not self._spool(len(done)).is_dir() or not self.output.kept_shard(result):
                break
            self._spool(len(done)).mkdir(exist_ok=True)  # no fields: an empty spool (a bucket keeps no folder)
            done[len(done)] = result
        for extra in (self.partial / JOURNAL_DIR).glob("shard-*"):
            if extra.name.split(".")[0] not in {shard_entry(self.partial, i).stem for i in done}:
                if extra.is_dir():
                    shutil.rmtree(extra)
                else:
                    extra.unlink()
        remove_unkept(self.partial, done)
        self.done = [done[i] for i in range(len(done))]
        self.skip = sum(r.shard.num_samples + len(r.errors) for r in self.done)

    def _spool(self, shard_id: int) -> Path:
        """Where a shard's field values wait for the finish (beside its journal entry)."""
        return self.partial / JOURNAL_DIR / f"shard-{shard_id:05d}.fields"

    def _flush(self) -> None:
        """Write the pending samples as the next shard; spool its fields, then journal it."""
        assert self.opts is not None
        sid = len(self.done)
        planned = self._stored
        if not self._pending:
            return
        sink = ShardSink(self.partial, sid, planned, self.fmt, self.opts, self.on_error, self.out)
        try:
            for res in self._pending:
                sink.add(res)
            result, names = sink.close()
        except BaseException:
            sink.abort()
            raise
        spool = self._spool(sid)
        shutil.rmtree(spool, ignore_errors=True)
        spool_tmp = spool.with_name(spool.name + ".tmp")
        shutil.rmtree(spool_tmp, ignore_errors=True)
        for name in save_fields(spool_tmp, self.specs, self._cells) if self.specs else []:
            fsync_file(spool_tmp / name)
        spool_tmp.mkdir(exist_ok=True)
        os.rename(spool_tmp, spool)
        self.done.append(self.output.shard_done(result, names))
        self._pending, self._cells, self._bytes, self._stored = [], {k: [] for k in self.specs}, 0, 0

    # ------------------------------------------------------------ finishing

    def close(self) -> Path | str:
        """Write the last shard, the index, fields, errors.json and the manifest; move the dataset into place (a
        URL: upload them, the manifest last). The dataset's folder, or its (redacted) URL."""
        if self.closed:
            return self.output.result_name
        self.closed = True
        try:
            self._finish()
        finally:
            self._release()
        return self.output.result_name

    def _release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _finish(self) -> None:
        if self.complete:
            self.output.finish_swap()
            return
        self._options_for(b"")  # no sample added: an empty dataset of the format's default payload
        self._flush()
        keys = [k for r in self.done for k in r.rel_paths]  # stored in the order added, named by their number
        index = stored_index(self.done, keys, np.asarray([int(k) for k in keys], dtype=np.int64))
        columns: dict[str, list[Any]] = {k: [] for k in self.specs}
        for sid, result in enumerate(self.done):
            store = FieldStore.load(self._spool(sid), {k: s.text for k, s in self.specs.items()},
                                    result.shard.num_samples, lambda rel, d=self._spool(sid): d / rel)
            for name in self.specs:
                columns[name] += store.cells(name)
        classes = integer_classes(index.labels.tolist(), self.classes)
        assert self.opts is not None
        manifest = Manifest(format=self.fmt.name, payload=self.opts.payload, num_samples=len(index), classes=classes,
                            shards=[r.shard for r in self.done], options=self.opts.record(),
                            source_type=SOURCE_TYPE, source_records=self.count, created_by=f"packer {__version__}",
                            created_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        errors = [replace(e, index=int(e.path)) for r in self.done for e in r.errors]  # sample n: source index n
        seal(self.output, index, errors, {}, manifest, self.specs, columns)

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self.close()
        else:
            self.closed = True  # the journaled shards stay in <out>.partial: resume=True goes on from them
            self._release()
