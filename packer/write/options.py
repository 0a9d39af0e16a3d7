"""Conversion options: everything that decides the bytes of the output, checked once, recorded in the manifest.

``make_options`` builds them from keyword arguments (the CLI's flags, or ``convert``'s ``**options``);
a format's own options come from its declared ``Option`` list and are kept by name in ``extra``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from packer.errors import DatasetError, OptionError, arg
from packer.formats import FORMATS, get_format
from packer.images.jpegregion import region_decode_available, region_decode_missing_reason
from packer.images.resize import ResizeSpec
from packer.layout.manifest import IMAGELESS, PAYLOADS

Validate = Literal["full", "header", "none"]
SampleOrder = Literal["shuffled", "source"]
SAMPLE_ORDERS = ("shuffled", "source")
DEFAULT_ORDER: SampleOrder = "shuffled"  # see docs/sampling.md: label mixing for block-shuffled reads


@dataclass
class ConvertOptions:
    """Everything that decides the bytes of the output (recorded in the manifest, see ``record``)."""

    format: str = "lmdb"
    payload: str = "encoded"
    validate: Validate = "full"
    shard_bytes: int | None = None  # None: the format's default
    resize: str | None = None  # "S" or "HxW" (raw payloads only; lossy, explicit)
    resize_mode: str = "stretch"  # for HxW: stretch, or fit (keep aspect, pad)
    upscale: bool = False
    compression: str | None = None  # a codec of the format's ``compressions`` (hdf5: lzf, gzip), raw payloads only
    decoder: str = "auto"
    order: SampleOrder = DEFAULT_ORDER  # sample order in the dataset: a seeded shuffle, or the scan's (ImageFolder's)
    seed: int = 0  # of the shuffled order
    skip_hidden: bool = False  # leave out names starting with "." (ImageFolder keeps them: hidden folders are classes)
    allow_empty: bool = False  # keep class folders without images as classes (ImageFolder's allow_empty)
    jpeg_restarts: bool = False  # encoded JPEGs rewritten losslessly with a restart marker per MCU (faster crops)
    extra: dict[str, Any] = field(default_factory=dict)  # the format's own options (Format.options), by name

    def record(self) -> dict[str, Any]:
        """The options as the manifest and the journal record them: flat, the format's own by name, no decoder."""
        common = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("decoder", "extra")}
        return {**common, **{o.name: self.extra.get(o.name) for o in get_format(self.format).options}}

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
        size = self.resize or get_format(self.format).implied_resize(self.record())
        return ResizeSpec.parse(size, self.resize_mode, self.upscale)

    def check(self) -> None:
        fmt = get_format(self.format)
        if self.payload not in PAYLOADS:
            raise OptionError(f"unknown payload {self.payload!r} (choose from {', '.join(PAYLOADS)})")
        if self.payload not in fmt.payloads:
            if self.payload == IMAGELESS:
                holding = ", ".join(n for n, f in FORMATS.items() if IMAGELESS in f.payloads)
                raise OptionError(f"format {self.format!r} stores images only: samples without an image (payload "
                                  f"'none') go to {holding}")
            raise OptionError(f"format {self.format!r} stores only {', '.join(sorted(fmt.payloads))} payloads")
        fmt.check_options(self.record())
        if self.validate not in ("full", "header", "none"):
            raise OptionError(f"unknown validation level {self.validate!r} (choose full, header or none)")
        if self.shard_bytes is not None and self.shard_bytes <= 0:
            raise OptionError(f"{arg('shard_bytes', self.shard_bytes, cli='shard-size')}: must be positive")
        if self.resize_spec is not None and self.payload != "raw":
            raise OptionError(f"{arg('resize')} changes pixels, so it needs {arg('payload', 'raw')} "
                              "(encoded payloads keep the source bytes)")
        if self.compression is not None:
            if self.compression not in fmt.compressions:
                raise OptionError(f"{arg('compression', self.compression)}: format {self.format!r} offers "
                                  f"{', '.join(sorted(fmt.compressions)) or 'no compression'}")
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
    common = {f.name for f in fields(ConvertOptions)} - {"format", "extra"}
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
