"""A conversion's options, each declared once: a dataclass field made by ``option`` (default, type, help text, flag),
from which ``convert``'s keywords, their ``Args:`` entries and ``packer convert``'s flags are all made.

Three groups: ``RunOptions`` (how a run goes, never recorded), ``SourceOptions`` (how SRC is read:
write/sources/base.py) and ``ConvertOptions`` (what decides the output's bytes, recorded in the manifest);
a format's own options are its ``Option``s (formats/base.py), kept by name in ``ConvertOptions.extra``.
"""

from __future__ import annotations

import inspect
import os
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypeVar

from packer.argtypes import int_in, size_arg
from packer.errors import DatasetError, OptionError, arg, render
from packer.formats import FORMATS, get_format
from packer.formats.base import Format
from packer.images.jpegregion import region_decode_available, region_decode_missing_reason
from packer.images.resize import ResizeSpec
from packer.layout.manifest import IMAGELESS, PAYLOADS
from packer.progress import progress_wanted

SAMPLE_ORDERS = ("shuffled", "source")
WDS = "wds"  # --to wds: a WebDataset export (write/export_wds.py), a sink and not a format: no options of its own
_DECLARED = "packer.option"  # the field metadata key of a declared option


@dataclass(frozen=True)
class Declared:
    """One option as ``convert`` takes it (``keyword``) and ``packer convert`` does (``--flag``), with the one help
    text both show: its ``arg`` marks name other options as the reader knows them (packer.errors.render)."""

    keyword: str  # convert's keyword
    field: str  # the dataclass field it sets (source_type sets SourceOptions.type)
    default: Any  # the keyword's default (and the flag's)
    accepts: str  # the keyword's type, as the signature and the docstring show it
    help: str
    flag: str | None = None  # the command line's name (without --); None: the Python API's only
    generated: bool = True  # the flag is made from this declaration (False: the command line adds its own)
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # the flag's argparse type (range-checked); None: text, or a switch
    wds: bool = True  # ``to="wds"`` takes it too (otherwise refused there unless left at its default)

    @property
    def switch(self) -> bool:
        """A ``bool`` option off by default: a flag without a value."""
        return self.default is False

    def named(self, value: object = ...) -> str:
        """The option (with ``value``) marked for a message, as the API or the command line names it."""
        return arg(self.keyword, value, cli=self.flag)


def option(default: Any, help: str, *, keyword: str = "", flag: str | None = "", generated: bool = True,
           metavar: str | None = None, choices: Iterable[str] | None = None,
           parse: Callable[[str], Any] | None = None, accepts: str = "", unset: Any = ..., wds: bool = True,
           secret: bool = False) -> Any:
    """A dataclass field declared as a conversion option (a ``Declared`` in its metadata). ``keyword``: convert's
    name where it is not the field's; ``flag``: the command line's where it is not the keyword's with ``-`` for
    ``_`` (None: none); ``accepts``: the keyword's type where it takes more than the field holds; ``unset``: the
    keyword's default where it is not the field's (payload: None, the format's own); ``secret``: left out of the
    dataclass's ``repr`` (credentials)."""
    spec = Declared(keyword=keyword, field="", default=unset, accepts=accepts, help=help, flag=flag,
                    generated=generated, metavar=metavar, choices=None if choices is None else tuple(choices),
                    parse=parse, wds=wds)
    return field(default=default, metadata={_DECLARED: spec}, repr=not secret)


def declared(cls: type) -> list[Declared]:
    """The options dataclass ``cls`` declares (its ``option`` fields), in field order, each completed from its field
    (name, type, default)."""
    found = []
    for f in fields(cls):
        spec = f.metadata.get(_DECLARED)
        if spec is None:
            continue
        keyword = spec.keyword or f.name
        found.append(replace(spec, keyword=keyword, field=f.name, accepts=spec.accepts or str(f.type),
                             default=f.default if spec.default is ... else spec.default,
                             flag=keyword.replace("_", "-") if spec.flag == "" else spec.flag))
    return found


def own_options(formats: Mapping[str, Format]) -> list[Declared]:
    """Every format's own options (``Format.options``), once each by name, in registry order, as declarations."""
    seen: dict[str, Declared] = {}
    for fmt in formats.values():
        for opt in fmt.options:
            seen.setdefault(opt.name, Declared(
                keyword=opt.name, field=opt.name, default=None, accepts="Any", help=opt.help,
                flag=opt.name.replace("_", "-"), metavar=opt.metavar, choices=opt.choices, parse=opt.type, wds=False))
    return list(seen.values())


def compression_help(formats: Mapping[str, Format]) -> str:
    """``compression``'s help, from what each format offers (``Format.compressions``)."""
    offers = "; ".join(f"{name}: {', '.join(sorted(fmt.compressions))}"
                       for name, fmt in sorted(formats.items()) if fmt.compressions)
    return (f"{arg('payload', 'raw')} only: compress the stored pixels with a codec the format offers ({offers}; "
            "gzip: smaller, read by any reader of the format; lzf: faster, h5py's own filter; default none)")


@dataclass(frozen=True)
class PoolSettings:
    """How the local pool moves work; the defaults suit every run (tests shrink them to reach the other paths)."""

    chunk: int = 16  # files per pool task: amortises IPC without hurting ordering latency
    # Chunks in flight per worker: enough that the workers keep going while this process commits a batch or
    # closes a shard, few enough to bound memory.
    ahead: int = 16
    ahead_bytes: int = 256 << 20  # ... and at most about this much prepared payload waiting (raw pixels are large)
    ring_bytes: int = 256 << 20  # at most this much shared ring for payloads from forked workers (0: pickle them)
    start_method: str | None = None  # of the worker processes; None: multiprocessing's default


@dataclass(frozen=True)
class RunOptions:
    """How a conversion runs: never recorded, the output's bytes do not depend on them."""

    on_error: Literal["skip", "raise"] = option(
        "skip", "skip: list a record that cannot be packed in errors.json, with its reason, and go on (default); "
        "raise: stop at the first (nothing is kept)", choices=("skip", "raise"))
    workers: int | None = option(None, "processes that read and validate the records (default: all cores; 0: in "
                                 "this process)", parse=int_in(0))
    overwrite: bool = option(False, "replace an existing packer dataset (or WebDataset export), only once the new one "
                             "is complete; anything else at the output path is refused")
    if_changed: bool = option(
        False, "convert only if the output is missing or stale: an output converted with the same options from the "
        "same source files (names, sizes, modification times; one stat per file) is reused and the summary says so; "
        f"a stale one is replaced only with {arg('overwrite', True)}", wds=False)
    resume: bool = option(
        False, "go on with an interrupted conversion of the same source and options (its finished shards are checked "
        "and kept; the result is identical to an uninterrupted run); an export is not resumed part-way: "
        "this only finishes the move into place that a killed export journaled")
    progress: bool | None = option(None, "a progress bar on stderr: None (default) when stderr is a terminal, True "
                                   "always, False never (the command line's -q: none)", flag=None)
    client: Any = option(
        None, "a dask.distributed.Client: the cluster's workers scan the class folders and write the shards (source "
        "and output on storage they all share, or in a bucket: a task then uploads its shard from its worker); the "
        "bytes are the same as a local run's (the command line opens one with --scheduler)", flag="scheduler",
        generated=False, wds=False)
    storage_options: dict[str, Any] | None = option(
        None, "a source or an output in object storage (s3://, gs://, az://, http(s)://): the storage client's "
        "settings, one set for every object the conversion reads or writes (obstore's keys: endpoint, region, "
        "aws_access_key_id, ...; never recorded or printed); default: the environment (AWS_*, GOOGLE_*, AZURE_*), "
        "AWS_PROFILE and instance roles. Refused where nothing is at a URL", flag="storage-option", generated=False,
        secret=True)
    staging_dir: str | None = option(
        None, "an output in object storage: the local folder where shards (an export's tars) are written before "
        "their upload (each deleted once uploaded, so it holds about three shards; default: the system's temporary "
        "folder)", metavar="DIR")
    pool: PoolSettings | None = option(None, "settings of the local process pool (PoolSettings in "
                                       "packer/write/options.py); the defaults suit every run", flag=None)

    def checked(self) -> RunOptions:
        """These options checked, with ``progress`` decided (here, where the bar is drawn, not in the workers)."""
        if self.on_error not in ("skip", "raise"):
            raise OptionError(f"unknown error policy {self.on_error!r} (choose skip or raise)")
        workers = self.workers
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
            raise OptionError(f"workers {workers!r}: expected a count >= 0 (0: in this process; None: all cores)")
        return replace(self, progress=progress_wanted(self.progress))

    def worker_count(self) -> int:
        """The processes that prepare records (0: this one)."""
        return os.cpu_count() or 1 if self.workers is None else self.workers


@dataclass
class ConvertOptions:
    """Everything that decides the bytes of the output (recorded in the manifest, see ``record``)."""

    format: str = "lmdb"  # convert's ``to``
    payload: str = option(
        "encoded", "encoded: the original file bytes (lossless, smallest; default where the format stores them); raw: "
        "decoded RGB pixels (no decoding in training, 5-10x larger; the only payload of bmp and mosaic)",
        choices=("encoded", "raw"), unset=None, accepts="str | None", wds=False)
    validate: Literal["full", "header", "none"] = option(
        "full", "full: decode every image (default, catches truncated files); header: read headers only; none: pack "
        "bytes unchecked", choices=("full", "header", "none"))
    shard_bytes: int | None = option(
        None, "about this many bytes per shard (a size such as 512MB on the command line; default: the format's: "
        f"1GB for lmdb, one file for hdf5 and memmap); {arg('to', WDS)}: at most this many per .tar (default: 16 or "
        "more shards of at most 256MB)", flag="shard-size", metavar="SIZE", parse=size_arg)
    resize: str | None = option(None, "raw payloads only, lossy: S = short side to S (aspect kept); HxW = exact shape",
                                metavar="S|HxW", accepts="str | int | None", wds=False)
    resize_mode: str = option("stretch", f"for {arg('resize')} HxW: stretch to the shape (default) or fit inside it "
                              "and pad with black", choices=("stretch", "fit"), wds=False)
    upscale: bool = option(False, f"let {arg('resize')} enlarge small images (default: never)", wds=False)
    compression: str | None = option(None, compression_help(FORMATS), wds=False,
                                     choices=sorted({c for f in FORMATS.values() for c in f.compressions}))
    decoder: str = option("auto", "the JPEG decoder that validates and decodes: auto, turbojpeg or pil (the same "
                          "pixels; not recorded)", flag=None)
    # sample order in the dataset: a seeded shuffle (see docs/sampling.md: label mixing for block-shuffled reads), or
    # the scan's (ImageFolder's)
    order: Literal["shuffled", "source"] = option(
        "shuffled", "sample order in the dataset. shuffled (default): a seeded shuffle, so neighbours on disk are "
        "unrelated and block-shuffled reading (packer.read.sampler) mixes labels in every batch; source: ImageFolder's "
        "order, dataset index i = ImageFolder index i. Either way ds.samples and ds.index_of(rel_path) map samples to "
        "their source files", choices=SAMPLE_ORDERS)
    seed: int = option(0, f"seed of {arg('order', 'shuffled')} and of the split's draw (default 0; recorded in the "
                       "manifest)", parse=int_in(0))
    skip_hidden: bool = option(
        False, "leave out hidden folders and files (names starting with '.', e.g. .ipynb_checkpoints), counted in the "
        "summary. Default: ImageFolder's rules, where a hidden folder is a class and a hidden image is a sample")
    allow_empty: bool = option(
        False, "keep class folders without images as classes with no samples (ImageFolder's allow_empty=True); "
        "default: refuse them, naming each, as ImageFolder does")
    jpeg_restarts: bool = option(
        False, "encoded payloads: rewrite each JPEG losslessly with a restart marker per MCU (the same DCT "
        "coefficients, so the same pixels; photos about the same size, flat or low-quality images larger; recorded in "
        "the manifest), so that training crops (RandomResizedCropDecode) decode only the crop's part of the file: "
        "faster crops, slightly slower whole decodes (docs/decoding.md has the figures). The stored bytes are then no "
        "longer the source files' (packer extract gives the rewritten ones)", wds=False)
    extra: dict[str, Any] = field(default_factory=dict)  # the format's own options (Format.options), by name

    def target(self) -> Format | None:
        """The format these options are for; None for the WebDataset export, which has no options of its own."""
        return None if self.format == WDS else get_format(self.format)

    def record(self) -> dict[str, Any]:
        """The options as the manifest and the journal record them: flat, the format's own by name, no decoder."""
        common = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("decoder", "extra")}
        fmt = self.target()
        return {**common, **{o.name: self.extra.get(o.name) for o in (fmt.options if fmt else ())}}

    @classmethod
    def from_record(cls, record: dict[str, Any], where: object = "manifest") -> ConvertOptions:
        """The options a manifest recorded (``record``'s inverse, ``decoder`` allowed); unknown non-empty entries
        are refused (old manifests list every format's options, empty where not given)."""
        common = {f.name for f in fields(cls)} - {"extra"}
        fmt = get_format(str(record.get("format")))
        own = {o.name for o in fmt.options}
        unknown = sorted(k for k, v in record.items() if k not in common | own and v is not None)
        if unknown:
            raise DatasetError(f"{where}: unknown conversion option(s) {', '.join(unknown)}")
        return cls(**{k: v for k, v in record.items() if k in common},
                   extra={k: v for k, v in record.items() if k in own})

    @property
    def resize_spec(self) -> ResizeSpec | None:
        fmt = self.target()
        size = self.resize or (fmt.implied_resize(self.record()) if fmt else None)
        return ResizeSpec.parse(size, self.resize_mode, self.upscale)

    def check(self) -> None:
        fmt = self.target()
        if self.payload not in PAYLOADS:
            raise OptionError(f"unknown payload {self.payload!r} (choose from {', '.join(PAYLOADS)})")
        if fmt is not None and self.payload not in fmt.payloads:
            if self.payload == IMAGELESS:
                holding = ", ".join(n for n, f in FORMATS.items() if IMAGELESS in f.payloads)
                raise OptionError(f"format {self.format!r} stores images only: samples without an image (payload "
                                  f"'none') go to {holding}")
            raise OptionError(f"format {self.format!r} stores only {', '.join(sorted(fmt.payloads))} payloads")
        if fmt is not None:
            fmt.check_options(self.record())
        if self.validate not in ("full", "header", "none"):
            raise OptionError(f"unknown validation level {self.validate!r} (choose full, header or none)")
        if self.shard_bytes is not None and self.shard_bytes <= 0:
            raise OptionError(f"{arg('shard_bytes', self.shard_bytes, cli='shard-size')}: must be positive")
        if self.resize_spec is not None and self.payload != "raw":
            raise OptionError(f"{arg('resize')} changes pixels, so it needs {arg('payload', 'raw')} "
                              "(encoded payloads keep the source bytes)")
        if self.compression is not None:
            offered = fmt.compressions if fmt is not None else frozenset()
            if self.compression not in offered:
                raise OptionError(f"{arg('compression', self.compression)}: format {self.format!r} offers "
                                  f"{', '.join(sorted(offered)) or 'no compression'}")
            if self.payload != "raw":
                raise OptionError(f"{arg('compression')} applies to raw payloads only: encoded JPEG/PNG bytes are "
                                  f"already compressed and would not shrink (use {arg('payload', 'raw')}, or drop "
                                  f"{arg('compression')})")
        if self.order not in SAMPLE_ORDERS:
            raise OptionError(f"unknown sample order {self.order!r} (choose {' or '.join(SAMPLE_ORDERS)})")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise OptionError(f"the order seed must be a non-negative integer, got {self.seed!r}")
        for name, value in (("skip_hidden", self.skip_hidden), ("allow_empty", self.allow_empty),
                            ("jpeg_restarts", self.jpeg_restarts)):
            if not isinstance(value, bool):
                raise OptionError(f"{name} must be True or False, got {value!r}")
        if self.jpeg_restarts:
            if self.payload != "encoded":
                raise OptionError(f"{arg('jpeg_restarts', True)} rewrites encoded JPEG bytes: it needs "
                                  f"{arg('payload', 'encoded')}")
            if not region_decode_available():
                raise OptionError(f"{arg('jpeg_restarts', True)} needs the compiled JPEG region decoder, which is "
                                  f"not built ({region_decode_missing_reason()}; docs/decoding.md)")


def scan_rules(record: dict[str, Any]) -> tuple[bool, bool]:
    """``(skip_hidden, allow_empty)`` as a manifest's options record them. Manifests written before they were
    recorded come from a scan that left hidden names out and kept empty classes."""
    return bool(record.get("skip_hidden", True)), bool(record.get("allow_empty", True))


def make_options(to: str, **given: Any) -> ConvertOptions:
    """ConvertOptions for format ``to`` from keyword fields and the format's own options, refusing unknown names."""
    fmt = get_format(to)
    common = {d.keyword for d in declared(ConvertOptions)}
    own = {o.name: o for o in fmt.options}
    others = {o.name: f.name for f in FORMATS.values() if f is not fmt for o in f.options}
    for key in sorted(set(given) - common - set(own)):
        if key in others:
            if given[key] is None:
                continue
            raise OptionError(f"{arg(key)} is an option of {arg('to', others[key])} only")
        known = ", ".join(sorted(common | set(own)))
        raise OptionError(f"unknown conversion option {key!r} for {arg('to', to)} (known: {known})")
    if given.get("payload") is None:
        given["payload"] = "encoded" if "encoded" in fmt.payloads else "raw"
    if given.get("resize") is not None:  # sizes may come as numbers (resize=256)
        given["resize"] = str(given["resize"])
    extra = {k: (str(v) if own[k].type is None and v is not None else v) for k, v in given.items() if k in own}
    return ConvertOptions(format=to, extra=extra, **{k: v for k, v in given.items() if k in common})


F = TypeVar("F", bound=Callable[..., Any])


def takes_options(keywords: Sequence[Declared], formats: Mapping[str, Format] | None = None) -> Callable[[F], F]:
    """Give a function that takes ``**options`` the signature and ``Args:`` entries of ``keywords`` (and, with
    ``formats``, their own options, which stay in ``**options``): ``help()`` and ``inspect.signature`` then show
    each keyword, its type, default and help, from its declaration alone."""
    def decorate(func: F) -> F:
        sig = inspect.signature(func)
        plain = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        rest = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD and formats]
        named = [inspect.Parameter(k.keyword, inspect.Parameter.KEYWORD_ONLY, default=k.default, annotation=k.accepts)
                 for k in keywords]
        func.__signature__ = sig.replace(parameters=[*plain, *named, *rest])  # type: ignore[attr-defined]
        func.__doc__ = _with_entries(func.__doc__ or "", [_entry(k) for k in keywords], formats)
        return func

    return decorate


def _entry(k: Declared) -> str:
    text = render(k.help)
    if k.choices and not any(f"{c}:" in text for c in k.choices):
        text += f" (one of: {', '.join(k.choices)})"
    default = "" if k.default is None or k.switch or "default" in text else f"; default {k.default!r}"
    return f"{k.keyword} ({k.accepts}): {text}{default}."


def _with_entries(doc: str, entries: list[str], formats: Mapping[str, Format] | None) -> str:
    """``doc`` with ``entries`` at the end of its ``Args:`` section, before its ``**options`` entry; that entry lists
    the formats' own options (from ``formats``), or goes (no ``formats``: the function takes no more)."""
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    indent = " " * (len(lines[start]) - len(lines[start].lstrip()) + 4)
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].strip()), len(lines))
    at = next((i for i in range(start + 1, end) if lines[i].lstrip().startswith("**options:")), end)
    wrap = textwrap.TextWrapper(116, initial_indent=indent, subsequent_indent=indent + "    ")
    own = []
    if formats is not None:
        listed = "; ".join(f"{name}: {', '.join(o.name for o in fmt.options)}" for name, fmt in formats.items()
                           if fmt.options)
        own = [wrap.fill(f"**options: the format's own options, for the format that takes them ({listed}); "
                         "packer convert --help explains each as its flag.")]
    return "\n".join([*lines[:at], *map(wrap.fill, entries), *own, *lines[end:]])
