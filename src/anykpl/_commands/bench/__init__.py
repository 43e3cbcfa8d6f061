"""Measure how close one producer gets to each shard's write limits, on the emulator.

For every record size and aggregation setting, a fresh stream on the emulator (limits on, in
its own process) takes a lone producer's saturating load; the emulator's per-second counts give
each shard's records/s and bytes/s as a share of its limits (1000 records/s, 1 MiB/s). Writes
bench.json, bench.md and bench.png (the plot needs matplotlib) and prints the table;
docs/bench.md explains what is measured.
"""

# Layout: ``_workload.py`` runs one case (the producer and its submitters), ``_analysis.py``
# turns its raw counts into rates, shares and percentiles (pure), ``_report.py`` writes the
# files. This module only parses options and runs the cases in order. (The docstring above is
# the command's --help description.)

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

__all__ = ("add_arguments", "run")

DEFAULT_SIZES = (100, 1024, 10240, 102400)
QUICK_SIZES = (100, 10240)
QUICK_DURATION = 3.0
QUICK_WARMUP = 1.0
#: The longest record the default producer accepts, less room for the partition key.
_LARGEST_SIZE = 1024 * 1024 - 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``anykpl bench`` options."""
    parser.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="user record sizes in bytes, comma separated "
        f"(default {','.join(map(str, DEFAULT_SIZES))}; "
        f"{','.join(map(str, QUICK_SIZES))} with --quick)",
    )
    parser.add_argument(
        "--aggregation",
        type=_aggregation,
        default=(True, False),
        help="aggregation settings to run: on, off or on,off (default on,off)",
    )
    parser.add_argument(
        "--duration",
        type=_at_least(2.0),
        default=None,
        help=f"measured seconds per case (default 20; {QUICK_DURATION:g} with --quick)",
    )
    parser.add_argument(
        "--warmup",
        type=_at_least(0.0),
        default=None,
        help=f"unmeasured seconds before each case (default 3; {QUICK_WARMUP:g} with --quick)",
    )
    parser.add_argument(
        "--shards", type=_count(1, 64), default=2, help="shards per stream (default 2)"
    )
    parser.add_argument(
        "--backend", choices=("asyncio", "trio"), default="asyncio", help="default asyncio"
    )
    parser.add_argument(
        "--submitters",
        type=_count(1, 1000),
        default=8,
        help="tasks calling submit() back to back (default 8)",
    )
    parser.add_argument(
        "--buffer",
        type=_at_least(0.05),
        default=1.0,
        help="the producer's outstanding limits, in seconds of the stream's capacity (default 1)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("bench-results"),
        help="directory for the results (default bench-results)",
    )
    parser.add_argument(
        "--endpoint",
        default=None,
        metavar="URL",
        help="measure this Kinesis endpoint ('aws' for the service's own) instead of a spawned "
        "emulator: needs --stream, an existing stream, which every case writes to; figures "
        "come from the producer's side (see docs/bench.md); credentials from botocore's chain",
    )
    parser.add_argument(
        "--stream", default=None, help="with --endpoint: the existing stream to write to"
    )
    parser.add_argument(
        "--region",
        default=None,
        help="with --endpoint: AWS region (default botocore's configured one, else us-east-1)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run for CI: fewer sizes, shorter cases (explicit options win)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the results document (as in bench.json) on stdout instead of the table; "
        "progress lines go to stderr either way",
    )


def run(args: argparse.Namespace) -> int:
    """Run every case, write the results, print the table; returns the exit status."""
    sizes: tuple[int, ...] = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    duration: float = args.duration or (QUICK_DURATION if args.quick else 20.0)
    warmup: float = (
        args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else 3.0)
    )
    missing = [m for m in ("moto", "boto3", "h11") if importlib.util.find_spec(m) is None]
    if args.backend == "trio" and importlib.util.find_spec("trio") is None:
        missing.append("trio")
    if missing:
        print(
            f"anykpl bench needs {', '.join(missing)}: pip install 'anykpl[bench]'",
            file=sys.stderr,
        )
        return 2

    if args.endpoint is None and (args.stream is not None or args.region is not None):
        print("anykpl bench: --stream and --region apply to --endpoint only", file=sys.stderr)
        return 2
    if args.endpoint is not None and args.stream is None:
        print(
            "anykpl bench: --endpoint needs --stream, an existing stream (the bench never "
            "creates or changes anything on an outside endpoint)",
            file=sys.stderr,
        )
        return 2

    import anyio

    from ...emulator import EmulatorClient, Limits, spawn
    from ._analysis import summarise, summarise_external
    from ._report import BAR, machine, markdown_table, size_label, write_json, write_plot
    from ._workload import EMULATOR_CONNECTION, Case, keys_per_shard, run_case

    cases = [
        Case(
            record_size=size,
            aggregation=aggregation,
            shards=args.shards,
            duration=duration,
            warmup=warmup,
            submitters=args.submitters,
            buffer=args.buffer,
        )
        for size in sizes
        for aggregation in args.aggregation
    ]
    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    print(
        f"anykpl bench: {len(cases)} case(s) of {warmup:g} s warm-up + {duration:g} s measured, "
        f"{args.shards} shard(s), {args.backend}, results in {output}/",
        file=sys.stderr,
        flush=True,
    )
    results: list[dict[str, Any]] = []
    with ExitStack() as stack:
        if args.endpoint is None:
            url: str | None = stack.enter_context(spawn(limits=Limits()))
            assert url is not None
            connection: Mapping[str, Any] = EMULATOR_CONNECTION
            stats: Callable[[], Mapping[str, Any] | None] = EmulatorClient(url).stats
            create: Callable[[str, int], None] | None = EmulatorClient(url).create_stream
        else:
            url = None if args.endpoint == "aws" else args.endpoint
            connection = _outside_connection(args.region)
            ranges = _hash_key_ranges(url, args.stream, connection)
            cases = [dataclasses.replace(case, shards=len(ranges)) for case in cases]
            stats, create = (lambda: None), None
        for number, case in enumerate(cases, 1):
            mode = "on" if case.aggregation else "off"
            if create is not None:
                stream = f"bench-{case.record_size}-{mode}-{uuid.uuid4().hex[:8]}"
                create(stream, case.shards)
                ranges = _hash_key_ranges(url, stream, connection)
            else:
                stream = args.stream
            keys = keys_per_shard(ranges)
            label = f"[{number}/{len(cases)}] {size_label(case.record_size)}, aggregation {mode}"
            with _ticker(label, case.warmup + case.duration):
                raw = anyio.run(
                    run_case, case, url, stream, keys, stats, connection, backend=args.backend
                )
            summary = summarise(raw) if create is not None else summarise_external(raw)
            summary["meets_bar"] = (
                summary["utilisation"] >= BAR and summary["throttled_records"] == 0
            )
            results.append(summary)
            latency = summary["latency_ms"]["p99"]
            print(
                f"[{number}/{len(cases)}] {size_label(case.record_size)}, aggregation {mode}: "
                f"utilisation {summary['utilisation'] * 100:.1f} % "
                f"({summary['binding_limit']}, worst shard), "
                f"{summary['user_records_per_second']:,.0f} user records/s, "
                f"throttled {summary['throttled_records']:,} "
                f"({summary['throttled_records_total']:,} whole run), "
                f"p99 {'–' if latency is None else f'{latency:,.0f}'} ms, "
                f"CPU {summary['cpu_seconds_per_100k'] or 0:.2f} s/100k",
                file=sys.stderr,
                flush=True,
            )

    document = {
        "benchmark": "anykpl bench",
        "bar": {"utilisation": BAR, "throttled_records": 0},
        "settings": {
            "sizes": list(sizes),
            "aggregation": list(args.aggregation),
            "duration": duration,
            "warmup": warmup,
            "shards": args.shards,
            "backend": args.backend,
            "submitters": args.submitters,
            "buffer": args.buffer,
            "endpoint": args.endpoint,
            "stream": args.stream,
            "emulator_limits": None
            if args.endpoint is not None
            else {
                "records_per_second": Limits().records_per_second,
                "bytes_per_second": Limits().bytes_per_second,
            },
        },
        "machine": machine(),
        "cases": results,
    }
    table = markdown_table(results)
    write_json(output / "bench.json", document)
    (output / "bench.md").write_text(table)
    plotted = write_plot(output / "bench.png", results)
    if args.json:
        json.dump(document, sys.stdout, indent=2)
        print()
    else:
        print(table)
    written = ["bench.json", "bench.md"] + (["bench.png"] if plotted else [])
    print(f"wrote {', '.join(str(output / name) for name in written)}", file=sys.stderr)
    if not plotted:
        print(
            "the plot was skipped: matplotlib is not installed (pip install 'anykpl[bench]')",
            file=sys.stderr,
        )
    return 0


@contextmanager
def _ticker(label: str, seconds: float, every: float = 0.5) -> Iterator[None]:
    """On a terminal, a line on stderr that counts a case's seconds while it runs (and is then
    replaced by the case's result); nothing when stderr is piped, where the result lines are
    the progress."""
    if not sys.stderr.isatty():
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(every):
            elapsed = time.monotonic() - start
            print(f"\r{label}: {elapsed:4.0f} of ~{seconds:.0f} s", end="", file=sys.stderr)
            sys.stderr.flush()

    thread = threading.Thread(target=tick, name="anykpl-bench-ticker", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        print("\r\033[K", end="", file=sys.stderr, flush=True)  # clear the line


def _outside_connection(region: str | None) -> dict[str, Any]:
    """Region and credentials for an outside endpoint: the region given, else botocore's, else
    us-east-1; credentials from botocore's chain, or dummy ones when it has none (a local
    emulator accepts any)."""
    import botocore.session

    from ._workload import EMULATOR_CONNECTION

    session = botocore.session.get_session()
    connection: dict[str, Any] = {
        "region": region or session.get_config_variable("region") or "us-east-1"
    }
    if session.get_credentials() is None:
        connection.update(EMULATOR_CONNECTION, region=connection["region"])
    return connection


def _hash_key_ranges(
    url: str | None, stream: str, connection: Mapping[str, Any]
) -> list[tuple[int, int]]:
    """The stream's open shards' hash key ranges, in shard order (ListShards through boto3,
    which the emulator's moto brings; imported by name as boto3 ships no type hints)."""
    boto3: Any = importlib.import_module("boto3")
    kinesis = boto3.client(
        "kinesis",
        region_name=connection["region"],
        endpoint_url=url,
        aws_access_key_id=connection.get("aws_access_key_id"),
        aws_secret_access_key=connection.get("aws_secret_access_key"),
    )
    try:
        shards = kinesis.list_shards(StreamName=stream)["Shards"]
    finally:
        kinesis.close()
    return [
        (int(s["HashKeyRange"]["StartingHashKey"]), int(s["HashKeyRange"]["EndingHashKey"]))
        for s in sorted(shards, key=lambda s: s["ShardId"])
        # open shards only: a closed parent (after a reshard) takes no writes
        if "EndingSequenceNumber" not in s["SequenceNumberRange"]
    ]


# -- argument types ---------------------------------------------------------------------------


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of byte counts: {text!r}") from None
    if not sizes or not all(1 <= size <= _LARGEST_SIZE for size in sizes):
        raise argparse.ArgumentTypeError(f"sizes are 1..{_LARGEST_SIZE} bytes, got {text!r}")
    return sizes


def _aggregation(text: str) -> tuple[bool, ...]:
    words = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not words or any(word not in ("on", "off") for word in words):
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, got {text!r}")
    return tuple(dict.fromkeys(word == "on" for word in words))


def _at_least(low: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value >= low or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low:g}, got {text}")
        return value

    return parse


def _count(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {value}")
        return value

    return parse
