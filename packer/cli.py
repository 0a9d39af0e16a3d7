"""Command line: argparse only. One ``cmd_<name>(args) -> int`` per subcommand; the work lives elsewhere.

Exit codes: 0 ok, 1 a problem was found (bad files, failed verification), 2 usage or refused.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap

from packer.errors import PackerError


def parse_bytes(text: str) -> int:
    """'1GB', '512MB', '64k', '1000' -> bytes (decimal units; KiB/MiB/GiB are binary)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 1GB, 2GiB)")
    num, unit, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    base = 1024 if binary else 1000
    return int(num * base ** "_kmgt".index(unit or "_"))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _parser(sub, name: str, help: str, examples: str, description: str = "") -> argparse.ArgumentParser:
    return sub.add_parser(
        name, help=help, description=(description or help),
        epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip(), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    from packer import __version__
    from packer.formats import FORMATS

    parser = argparse.ArgumentParser(
        prog="packer",
        description="Pack loose image folders into few large files (LMDB, HDF5, numpy memmap, BMP, mosaic) "
        "and read them back fast with PyTorch.",
        epilog="Run 'packer COMMAND --help' for the options and examples of each command.",
    )
    parser.add_argument("--version", action="version", version=f"packer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = _parser(sub, "convert", "pack a folder of images into a dataset", """
        packer convert imgs/ --to lmdb                # -> imgs.lmdb/ beside imgs/
        packer convert imgs/ --to lmdb -o /fast/imgs.lmdb --workers 8
        packer convert imgs/ --to lmdb --validate header   # faster; catches fewer damaged files
        packer convert imgs/ --to lmdb --payload raw --resize 256   # decoded once, short side 256
        packer convert imgs/ --to lmdb --resume       # go on after Ctrl-C, a kill or a full disk
        packer convert imgs/ --to lmdb --order source      # keep ImageFolder's sample order (indices)
        """, description="Pack a folder of images (ImageFolder layout root/<class>/<img>, or flat) into one "
        "dataset directory. Every source file is either packed or listed with its reason in errors.json.")
    p.add_argument("source", help="folder of images")
    p.add_argument("--to", dest="format", default="lmdb", choices=sorted(FORMATS), help="output format (default lmdb)")
    p.add_argument("-o", "--output", help="output directory (default: <source>.<format> beside the source)")
    p.add_argument("--payload", choices=("encoded", "raw"), default="encoded",
                   help="encoded: the original file bytes (lossless, smallest; default); "
                   "raw: decoded RGB pixels (no decoding in training, 5-10x larger)")
    p.add_argument("--validate", choices=("full", "header", "none"), default="full",
                   help="full: decode every image (default, catches truncated files); header: read headers only; "
                   "none: pack bytes unchecked")
    p.add_argument("--on-error", choices=("skip", "raise"), default="skip",
                   help="skip: report bad files in errors.json and go on (default); raise: stop at the first")
    p.add_argument("--workers", type=int, default=None, help="processes reading and validating (default: all cores)")
    p.add_argument("--shard-size", type=parse_bytes, default=None, metavar="SIZE",
                   help="approximate shard size, e.g. 512MB (default: the format's, 1GB for lmdb)")
    p.add_argument("--resize", metavar="S|HxW",
                   help="raw payloads only, lossy: S = short side to S (aspect kept); HxW = exact shape")
    p.add_argument("--resize-mode", choices=("stretch", "fit"), default="stretch",
                   help="for --resize HxW: stretch to the shape (default) or fit inside it and pad with black")
    p.add_argument("--upscale", action="store_true", help="let --resize enlarge small images (default: never)")
    p.add_argument("--order", choices=("shuffled", "source"), default="shuffled",
                   help="sample order in the dataset. shuffled (default): a seeded shuffle, so neighbours on disk "
                   "are unrelated and block-shuffled reading (packer.sampler) mixes labels in every batch; "
                   "source: ImageFolder's order, dataset index i = ImageFolder index i. Either way "
                   "ds.samples and ds.index_of(rel_path) map samples to their source files")
    p.add_argument("--seed", type=int, default=0, help="seed of --order shuffled (default 0; recorded in the manifest)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (only once the new one is complete)")
    p.add_argument("--resume", action="store_true",
                   help="go on with an interrupted conversion of the same source and options (its finished "
                   "shards are checked and kept; the result is identical to an uninterrupted run)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)

    p = _parser(sub, "info", "describe a packed dataset", """
        packer info imgs.lmdb
        packer info imgs.lmdb --json | jq .num_samples
        """)
    p.add_argument("dataset")
    p.add_argument("--json", action="store_true", help="print the manifest and summary as JSON")
    p.set_defaults(func=cmd_info)

    p = _parser(sub, "verify", "check a packed dataset (exit 1 on any problem)", """
        packer verify imgs.lmdb                    # files present, checksums, counts
        packer verify imgs.lmdb --against imgs/    # and every source file packed identically or reported
        packer verify imgs.lmdb --deep             # and decode every sample, shapes as recorded
        """)
    p.add_argument("dataset")
    p.add_argument("--deep", action="store_true",
                   help="also decode every sample (strictly) and check it against the stored shape")
    p.add_argument("--against", metavar="SRC", help="the source folder to compare with")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_verify)

    p = _parser(sub, "extract", "write a packed dataset's images back as files", """
        packer extract imgs.lmdb restored/               # restored/<class>/<file>, byte-identical
        packer extract imgs.lmdb restored/ --overwrite   # replace files that exist already
        """, description="Write every sample back under its original relative path inside DIR: the original "
        "bytes for encoded payloads; PNG (lossless pixels, extension changed to .png) for raw payloads. "
        "Paths that would land outside DIR are refused, and so are existing files unless --overwrite.")
    p.add_argument("dataset")
    p.add_argument("dir", help="destination folder (created if missing)")
    p.add_argument("--overwrite", action="store_true", help="replace files that exist already")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_extract)

    p = _parser(sub, "sample", "generate a folder of photo-like JPEGs to try packer on", """
        packer sample imgs/ --count 2000 --classes 10
        packer sample flat/ --count 100 --classes 0     # flat folder, no class folders
        """, description="Write an ImageFolder of synthetic photo-like JPEGs (about 500x375, about 100 KB at "
        "quality 90, like ImageNet), deterministic for a seed.")
    p.add_argument("output")
    p.add_argument("--count", type=int, default=2000)
    p.add_argument("--classes", type=int, default=10, help="class folders (0: a flat folder)")
    p.add_argument("--size", default="375x500", help="HxW around which sizes vary by 10%% (default 375x500)")
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_sample)
    return parser


def cmd_convert(args) -> int:
    from packer.convert import convert

    res = convert(
        args.source, args.output, to=args.format, payload=args.payload, validate=args.validate,
        on_error=args.on_error, workers=args.workers, shard_bytes=args.shard_size,
        resize=args.resize, resize_mode=args.resize_mode, upscale=args.upscale,
        overwrite=args.overwrite, resume=args.resume, progress=not args.quiet, order=args.order, seed=args.seed,
    )
    total = res.num_samples + len(res.errors)
    print(
        f"packed {res.num_samples} of {total} images into {res.output} in {res.seconds:.1f} s "
        f"({res.files_per_second:.0f} files/s, {res.bytes_read / 1e6 / max(res.seconds, 1e-9):.0f} MB/s)"
    )
    if res.errors:
        print(f"{len(res.errors)} files not packed: see {res.output / 'errors.json'}")
    return 1 if res.errors else 0


def info_summary(path) -> dict:
    from packer.manifest import read_manifest

    m = read_manifest(path)
    from dataclasses import asdict

    data = asdict(m)
    data["total_bytes"] = sum(f.num_bytes for f in m.all_files())
    return data


def cmd_info(args) -> int:
    data = info_summary(args.dataset)
    if args.json:
        print(json.dumps(data, indent=1, ensure_ascii=False))
        return 0
    classes = data["classes"]
    shown = ", ".join(classes[:8]) + (f", ... ({len(classes)} in all)" if len(classes) > 8 else "")
    rows = [
        ("dataset", str(args.dataset)),
        ("format", data["format"]),
        ("payload", data["payload"] + (" (original file bytes)" if data["payload"] == "encoded" else " (HWC uint8 RGB)")),
        ("samples", f"{data['num_samples']:,}"),
        ("classes", f"{len(classes)}: {shown}" if classes else "none (flat folder, label -1)"),
        ("shards", f"{len(data['shards'])}, {human_bytes(data['total_bytes'])} in all"),
        ("not packed", f"{data['num_errors']} (see errors.json)" if data["num_errors"] else "0"),
        ("options", ", ".join(f"{k}={v}" for k, v in data["options"].items())),
        ("source", data["source"]),
        ("created", f"{data['created_at']} by {data['created_by']}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_verify(args) -> int:
    from packer.verify import verify

    report = verify(args.dataset, against=args.against, progress=not args.quiet, deep=args.deep)
    checked = ", ".join(f"{v} {k}" for k, v in report.checked.items())
    if report.ok:
        print(f"ok: {args.dataset} ({checked})")
        return 0
    for p in report.problems[:50]:
        print(f"problem: {p}")
    if len(report.problems) > 50:
        print(f"... and {len(report.problems) - 50} more")
    print(f"FAILED: {len(report.problems)} problems in {args.dataset}")
    return 1


def cmd_extract(args) -> int:
    from packer.extract import extract

    res = extract(args.dataset, args.dir, overwrite=args.overwrite, progress=not args.quiet)
    print(f"wrote {res.num_files} files ({human_bytes(res.num_bytes)}) to {res.output}")
    if res.as_png:
        print("raw payload: images written as PNG (the stored pixels, losslessly); names end in .png "
              "instead of the original extension")
    return 0


def cmd_sample(args) -> int:
    from packer.sample import make_sample

    try:
        h, w = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        raise PackerError(f"--size {args.size!r}: expected HxW, e.g. 375x500") from None
    total = make_sample(args.output, count=args.count, classes=args.classes, size=(h, w), seed=args.seed,
                        quality=args.quality, progress=not args.quiet)
    print(f"wrote {args.count} images ({human_bytes(total)}) to {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except PackerError as exc:
        print(f"packer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("packer: interrupted", file=sys.stderr)
        return 130
