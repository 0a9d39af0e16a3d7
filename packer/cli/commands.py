"""One ``cmd_<name>(args) -> int`` per subcommand: call the function below that does the work, print its
result, return the exit code (see ``packer.cli.parser.EXIT_CODES``)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping
from typing import Any

from packer.errors import PackerError, under_way
from packer.units import human_bytes

JSON_SCHEMA = 1  # of the --json documents (docs/library.md): raised when a field changes meaning or goes away
JSON_COMMANDS = ("info", "convert", "verify", "extract", "sample")  # those that print the envelope below


def json_document(command: str, exit_code: int, fields: Mapping[str, Any]) -> str:
    """The one JSON document ``packer COMMAND --json`` prints on stdout: the envelope every command shares
    (docs/library.md), then the command's own fields."""
    from packer._version import __version__

    envelope = {"command": command, "packer_version": __version__, "schema": JSON_SCHEMA, "ok": exit_code == 0,
                "exit_code": exit_code}
    return json.dumps({**envelope, **fields}, indent=1)


def wants_json(args) -> bool:
    """``--json`` given to a command that prints the envelope (profile and bench take a file name instead)."""
    return args.command in JSON_COMMANDS and bool(args.json)


def bar_unless_quiet(args) -> bool | None:
    """``progress=`` of a command's call: none with ``-q``, else a bar on a terminal only (packer.progress)."""
    return False if args.quiet else None


def cmd_convert(args) -> int:
    import contextlib

    from packer.formats import FORMATS
    from packer.write.convert import SPLIT, convert, convert_split, keywords
    from packer.write.options import own_options

    flags = [o for o in [*keywords(), *own_options(FORMATS)] if o.flag is not None and o.generated]
    given: dict[str, Any] = {o.keyword: vars(args)[o.keyword] for o in flags if o.keyword != SPLIT}
    given["progress"] = bar_unless_quiet(args)
    given["storage_options"] = storage_options(args.storage_option) or None  # a local run refuses them (convert)
    if args.scheduler:
        from packer.write.cluster import open_client

        cluster = open_client(args.scheduler)
    else:
        cluster = contextlib.nullcontext()
    with cluster as client:
        if client is not None:
            given["client"] = client
        if args.split is None:
            results = [convert(args.source, args.output, to=args.format, **given)]
        else:
            results = list(convert_split(args.source, args.output, split=args.split, to=args.format, **given))
    code = max(int(bool(res.errors)) for res in results)  # 1: some records were not packed (errors.json)
    if args.json:
        print(json_document("convert", code, {"outputs": [res.to_json() for res in results]}))
        return code
    for res in results:
        _report_convert(res, args.quiet)
    return code


def _report_convert(res, quiet: bool) -> None:
    """Print what one conversion did (``quiet``: nothing, the errors went to stderr)."""
    from packer.write.summary import conversion_summary, describe_left_out

    if res.reused and not quiet:
        print(f"reused {res.output}: up to date (same options, same source files, sizes and times)")
    elif res.nothing_to_resume and not quiet:
        print(f"nothing to resume: {res.output} is complete ({res.nothing_to_resume}); nothing was done")
    elif not quiet:
        packed = conversion_summary(res.num_samples, res.ignored, res.errors)
        rate = res.bytes_read / 1e6 / max(res.seconds, 1e-9)
        into = str(res.output) if "://" in str(res.output) else f"{res.output}/"  # a folder ends in /, a URL not
        print(f"{packed} into {into} in {res.seconds:.1f} s ({res.files_per_second:.0f} files/s, "
              f"{rate:.0f} MB/s)")
        if res.rewritten is not None:
            kept = res.num_samples - res.rewritten
            why = "not 8-bit YCbCr or grayscale JPEGs, or progressive ones missing scans, or damaged"
            print(f"--jpeg-restarts: {res.rewritten:,} of {res.num_samples:,} samples stored rewritten with a restart "
                  "marker per MCU (the same pixels)" + (f"; {kept:,} as they were ({why})" if kept else ""))
        left_out = describe_left_out(res.ignored, res.not_images, res.errors)
        if left_out:
            print(f"left out: {left_out}")


def cmd_info(args) -> int:
    from packer.layout.manifest import dataset_directory
    from packer.layout.remote import is_remote
    from packer.storage.url import refuse_url
    from packer.tools.info import dataset_info, info_rows

    if is_remote(args.dataset):
        # no manifest at the URL, no access: exit 2
        data = dataset_info(args.dataset, args.cache_dir, url_options(args, args.dataset))
    else:
        refuse_url(args.dataset, "packer info")
        url_options(args, args.dataset)  # --storage-option with a path: refused
        dataset_directory(args.dataset)  # not a dataset at all: exit 2; one failing its checks: exit 1
        with under_way():
            data = dataset_info(args.dataset)
    if args.json:
        code = 1 if data["problems"] else 0
        print(json_document("info", code, data))
        return code
    rows = info_rows(args.dataset, data)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 1 if data["problems"] else 0  # a file missing or of another size: the dataset fails its checks


def cmd_verify(args) -> int:
    from packer.layout.manifest import dataset_directory
    from packer.layout.remote import is_remote
    from packer.storage.url import redact, refuse_urls
    from packer.tools.verify import verify

    refuse_urls("packer verify --against", args.against)
    if not is_remote(args.dataset):
        refuse_urls("packer verify", args.dataset)  # a scheme packer does not read
        dataset_directory(args.dataset)  # not a dataset at all: exit 2; one failing its checks: exit 1
    report = verify(args.dataset, against=args.against, progress=bar_unless_quiet(args), deep=args.deep,
                    cache_dir=args.cache_dir, storage_options=url_options(args, args.dataset))
    shown = redact(str(args.dataset))
    if args.json:
        print(json_document("verify", 0 if report.ok else 1, {"dataset": shown, **report.to_json()}))
        return 0 if report.ok else 1
    checked = ", ".join(f"{v} {k}" for k, v in report.checked.items())
    if report.ok:
        print(f"ok: {shown} ({checked})")
        return 0
    for p in report.problems[:50]:
        print(f"problem: {p}")
    if len(report.problems) > 50:
        print(f"... and {len(report.problems) - 50} more")
    print(f"FAILED: {len(report.problems)} problems in {shown}")
    return 1


def cmd_extract(args) -> int:
    from packer.storage.url import redact
    from packer.tools.extract import extract

    res = extract(args.dataset, args.dir, overwrite=args.overwrite, progress=bar_unless_quiet(args),
                  cache_dir=args.cache_dir, storage_options=url_options(args, args.dataset))
    if args.json:
        print(json_document("extract", 0, {"dataset": redact(str(args.dataset)), **res.to_json()}))
        return 0
    print(f"wrote {res.num_files} files ({human_bytes(res.num_bytes)}) to {res.output}")
    if res.as_png:
        print("raw payload: images written as PNG (the stored pixels, losslessly); names end in .png "
              "instead of the original extension")
    if res.kept_extension:
        print(f"{res.kept_extension} of them kept their original name plus .png (e.g. a.jpg.png): another "
              "file of the same name with another extension is in the same folder")
    return 0


def cmd_sample(args) -> int:
    from packer.tools.sample import make_sample

    total = make_sample(args.output, count=args.count, classes=args.classes, size=args.size, seed=args.seed,
                        quality=args.quality, progress=bar_unless_quiet(args))
    if args.json:
        print(json_document("sample", 0, {"output": str(args.output), "count": args.count, "classes": args.classes,
                                          "num_bytes": total}))
        return 0
    print(f"wrote {args.count} images ({human_bytes(total)}) to {args.output}")
    return 0


def cmd_profile(args) -> int:
    from packer.diagnose.plots import plot_sweep, require_matplotlib
    from packer.diagnose.sweep import RandomCrop, default_workers, sweep
    from packer.images.crop import RandomResizedCropDecode
    from packer.read.dataset import open_dataset

    if args.plot:
        require_matplotlib()
    workers = default_workers() if args.workers == "auto" else args.workers
    batch_sizes = args.batch_size
    pins = []
    for v in args.pin_memory.split(","):
        if v.strip() not in ("on", "off"):
            raise PackerError(f"--pin-memory {args.pin_memory!r}: expected off, on or off,on")
        pins.append(v.strip() == "on")
    from packer.layout.manifest import dataset_directory
    from packer.layout.remote import default_cache_dir, is_remote
    from packer.storage.url import refuse_url

    remote, options = is_remote(args.dataset), url_options(args, args.dataset)
    if not remote:
        refuse_url(args.dataset, "packer profile")
        dataset_directory(args.dataset)  # not a dataset at all: exit 2; one failing its checks: exit 1
    with under_way():  # a URL's shards come through the node's cache, as in training
        fused = args.train_crop and args.crop
        ds = open_dataset(args.dataset, image="tensor", decoder=args.decoder,
                          crop=RandomResizedCropDecode(args.crop) if fused else None,
                          transform=RandomCrop(args.crop) if args.crop and not fused else None,
                          cache_dir=(args.cache_dir or default_cache_dir()) if remote else None,
                          storage_options=options)
    if args.cache:
        from packer.read.dataset import CachedDataset

        ds = CachedDataset(ds, args.cache, progress=bar_unless_quiet(args))
    res = sweep(ds, workers=workers, batch_sizes=batch_sizes, pin_memory=pins, step_ms=args.step_ms,
                batches=args.batches, device=args.device, start_method=args.start_method,
                progress=bar_unless_quiet(args), collate=None if args.crop else list)
    if args.plot:
        plot_sweep(res, args.plot)
    if args.json == "-":
        print(json.dumps(res.to_dict(), indent=1))
    else:
        print(res.report())
        if args.plot:
            print(f"chart: {args.plot}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res.to_dict(), fh, indent=1)
            print(f"figures: {args.json}")
    return 0 if res.feasible else 1


def cmd_doctor(args) -> int:
    from packer.diagnose.doctor import diagnose, render

    report = diagnose(args.path, seconds=args.seconds, progress=not args.json,
                      storage_options=storage_options(args.storage_option))
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def cmd_bench(args) -> int:
    if args.decoders:
        return _bench_decoders(args)
    if not args.paths:
        raise PackerError("packer bench needs at least one PATH (a folder or a packed dataset), or --decoders")
    from packer.diagnose.bench import BenchOptions, run_bench
    from packer.diagnose.reports import bench_table, print_progress
    from packer.diagnose.system import usable_cores

    remote = _bench_is_remote(args)
    if args.plot:
        from packer.diagnose.plots import require_matplotlib

        require_matplotlib()  # before minutes of measuring
    caches = ("cold",) if args.cold else ("warm",) if args.warm else ("cold", "warm")
    workers = args.workers or (min(8, usable_cores()),)
    options = BenchOptions(
        levels=args.levels or (("loader",) if remote else ("read", "decode", "loader")),
        orders=args.orders or (("block",) if remote else ("sequential", "shuffle", "block")),
        caches=caches, workers=workers, batch_size=args.batch_size,
        pin_memory=args.pin_memory, repeats=args.repeats, limit=args.limit, seed=args.seed,
        block_bytes=args.block_size, open_blocks=args.open_blocks, run=args.run, ceiling_bytes=args.ceiling_size,
        emulate=None if remote else args.emulate, read_iops=args.read_iops, read_bps=args.read_bps,
    )
    if remote:
        return _bench_remote(args, options)
    report = run_bench(args.paths, options, log=None if args.quiet else print_progress)
    if sys.argv[1:2] == ["bench"]:
        report["command"] = shown_command(sys.argv[1:])
    if args.json != "-":
        print(bench_table(report))
    if args.json:
        _write_json(report, args.json)
    if args.plot:
        from packer.diagnose.plots import plot_bench

        plot_bench(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout)
    return 0


def _bench_is_remote(args) -> bool:
    """Whether ``packer bench`` reads by URL: a URL given, or a link emulated (``--emulate s3``, --latency,
    --bandwidth); one run is all URLs or all local paths."""
    from packer.diagnose.link import LINK_PRESETS
    from packer.layout.remote import is_remote

    urls = [p for p in args.paths if is_remote(p)]
    emulated = args.emulate in LINK_PRESETS or args.latency is not None or args.bandwidth is not None
    if urls and len(urls) != len(args.paths):
        raise PackerError("packer bench reads either URLs or local paths in one run, not both")
    if (urls or emulated) and (args.read_iops or args.read_bps or (args.emulate and not emulated)):
        raise PackerError("--emulate hdd/nfs/ssd, --read-iops and --read-bps throttle a local disk; on a URL use "
                          "--emulate s3, --latency or --bandwidth")
    if (urls or emulated) and args.plot:
        raise PackerError("--plot charts a local bench; on a URL, --json keeps every figure")
    if not urls and (args.storage_option or (args.cache_dir and not emulated)):
        raise PackerError(URL_ONLY)
    return bool(urls) or emulated


def _bench_remote(args, options) -> int:
    """``packer bench URL`` (or local datasets served through ``--emulate s3``): loader passes by URL."""
    from contextlib import nullcontext

    from packer.diagnose.bench_remote import RemoteOptions, Target, emulated_targets, remote_table, run_remote_bench
    from packer.diagnose.reports import print_progress

    opts = RemoteOptions(cache_dir=args.cache_dir, cache_limit=args.cache_limit, remote_mode=args.remote_mode)
    if args.emulate or args.latency is not None or args.bandwidth is not None:
        ctx: Any = emulated_targets(args.paths, args.emulate, args.latency, args.bandwidth)
    else:
        ctx = nullcontext([Target(p, storage_options(args.storage_option)) for p in args.paths])
    with ctx as targets:
        report = run_remote_bench(targets, options, opts, log=None if args.quiet else print_progress)
    if sys.argv[1:2] == ["bench"]:
        report["command"] = shown_command(sys.argv[1:])
    if args.json != "-":
        print(remote_table(report))
    if args.json:
        _write_json(report, args.json)
    return 0


URL_ONLY = "--storage-option and --cache-dir are for a dataset at a URL (s3://, gs://, az://, http(s)://)"


def url_options(args, location: str) -> dict[str, str] | None:
    """A command's ``--storage-option`` pairs for a dataset at a URL; given with a local path, refused in one line
    (never silently ignored; ``--cache-dir`` is harmless there, and scripts pass it for both)."""
    from packer.layout.remote import is_remote

    if not is_remote(location):
        if args.storage_option:
            raise PackerError("--storage-option is for a dataset at a URL (s3://, gs://, az://, http(s)://)")
        return None
    return storage_options(args.storage_option)


def shown_command(argv: list[str]) -> str:
    """``packer ARGV`` as a report records it: each ``--storage-option`` value left out (``KEY=...``: it may be a
    secret), URLs redacted."""
    import shlex

    from packer.storage.url import redact_text

    flag = "--storage-option"
    out, hide = [], False
    for arg in argv:
        name, eq, value = arg.partition("=")
        if hide:
            arg, hide = f"{name}=...", False
        elif len(name) > 2 and flag.startswith(name):  # argparse takes an abbreviation too
            arg, hide = (f"{name}={value.partition('=')[0]}=..." if eq else name), not eq
        out.append(redact_text(arg))
    return shlex.join(["packer", *out])


def storage_options(pairs: list[str]) -> dict[str, str]:
    """``--storage-option KEY=VALUE`` pairs as the store's configuration; a bad pair is one line naming it (never
    its value: it may be a secret)."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():  # no "=": the argument is shown only where it reads as a key (no secret)
            shown = key.strip() if eq or re.fullmatch(r"[a-z][a-z0-9_]{0,63}", key.strip()) else ""
            raise PackerError(f"--storage-option {shown or '?'}: expected KEY=VALUE"
                              + ("" if shown else " (the argument is not shown: it may be a secret)"))
        out[key.strip()] = value
    return out


def _bench_decoders(args) -> int:
    """``packer bench --decoders [DATASET|FOLDER]``: per-core decoder rates and packer's decode overhead."""
    from packer.diagnose.decoders import bench_decoders

    if len(args.paths) > 1:
        raise PackerError("packer bench --decoders takes one DATASET or FOLDER (or none: generated samples)")
    doc = bench_decoders(args.paths[0] if args.paths else None, sizes=list(args.sizes),
                         backends=args.backends.split(",") if args.backends else None, limit=args.limit or 200,
                         seconds=args.seconds, batch_size=args.batch_size,
                         out=sys.stderr if args.json == "-" else sys.stdout)  # keep stdout for the JSON
    if args.json:
        _write_json(doc, args.json)
    return 0


def _write_json(doc: Mapping[str, Any], target: str) -> None:
    """``--json -``: the document on stdout; ``--json FILE``: into FILE, and a line saying so."""
    if target == "-":
        print(json.dumps(doc, indent=1))
    else:
        with open(target, "w") as fh:
            json.dump(doc, fh, indent=1)
        print(f"wrote {target}")
