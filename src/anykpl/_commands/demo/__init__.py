"""Run an IoT fleet through the producer into a local Kinesis, then read the stream back and
prove that every acknowledged record is in it.

What ``anykpl demo`` does, in order:

1. Starts the emulator (``anykpl.emulator.spawn``) in its own process, with the service's
   per-shard write limits on (1000 records/s and 1 MiB/s), and creates the stream
   (``--shards``, default 4). ``--endpoint`` uses an existing endpoint, or AWS, instead.
2. Runs the workload for ``--duration`` seconds: ``--devices`` devices (default 5,000), each
   sending a small JSON reading every ``1/--rate`` seconds (default 0.8 readings/s, about 4,000
   readings/s in all), plus a burst every ``--burst-every`` seconds in which a tenth of the
   devices send ``--burst-size`` alert readings at once. The device id is the partition key;
   each reading carries its device's sequence number, so every record is unique.
3. Shows live progress: readings/s offered and acknowledged, throttled and retried records,
   p50/p99 put latency, and each shard's MiB/s and records/s against its limits. On a terminal
   this is a ``rich`` live table; elsewhere (CI) a plain line every two seconds.
4. Closes the producer, reads every shard from TRIM_HORIZON, deaggregates, and prints a
   verdict: acknowledged records present, missing, duplicated, unexpected.

The exit status is 0 when every acknowledged record is in the stream and nothing unexpected is,
and 1 otherwise (2 for bad options). ``rich`` is optional (``pip install 'anykpl[demo]'``).

Layout, one job per module, in the order a run meets them (``anykpl._commands.bench`` is cut the
same way)::

    __init__.py      the command: options, the choice of view, the run from start to verdict
    _target.py       where to: the emulator started here, or --endpoint with its TLS checks
                     and credentials
    _workload.py     what the devices send (Workload, DeviceGroup)
    _putting.py      the only async part: readings into the Producer, results into the Tally
    _bookkeeping.py  counts, latencies, per-shard rates (Tally, LatencyHistogram, ShardRate)
    _chaos.py        --chaos: a storm, a hot device, a split and resets, on schedule
    _views.py        the progress while it runs: a rich live table, plain lines, or nothing
    _timeline.py     the run second by second, for --json and the --plot picture
    _report.py       the summary after it: the producer's figures, each shard, the verdict

The workload and the bookkeeping are synchronous and take the time as an argument, so they are
tested without an event loop; only ``_putting.py`` awaits. The names the demo's single module
used to define stay importable from here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from ... import readback
from ._bookkeeping import RATE_WINDOW as RATE_WINDOW
from ._bookkeeping import LatencyHistogram, ShardRate, Tally, shard_rates_from_emulator
from ._bookkeeping import percentile as percentile
from ._chaos import CHAOS_DURATION, Chaos
from ._putting import ACKNOWLEDGE_BATCH as ACKNOWLEDGE_BATCH
from ._putting import GROUP_SIZE as GROUP_SIZE
from ._putting import TICK as TICK
from ._putting import EmulatorStats, produce
from ._putting import RunReport as RunReport
from ._report import Printer, report_run, report_verdict
from ._target import DEMO_CREDENTIALS as DEMO_CREDENTIALS
from ._target import Target as Target
from ._target import botocore_client, started_target, unverified_quietly
from ._timeline import Timeline, matplotlib_missing, plot
from ._views import MIB as MIB
from ._views import PLAIN_EVERY as PLAIN_EVERY
from ._views import REFRESH_EVERY as REFRESH_EVERY
from ._views import LiveView as _LiveView
from ._views import NoView as _NoView
from ._views import PlainView as _PlainView
from ._views import Progress as Progress
from ._views import ProgressView
from ._workload import BURST_FRACTION, DeviceGroup, Workload, run_prefix
from ._workload import device_name as device_name

__all__ = (
    "DeviceGroup",
    "LatencyHistogram",
    "ShardRate",
    "Tally",
    "Workload",
    "add_arguments",
    "produce",
    "run",
    "shard_rates_from_emulator",
)


# -- options ------------------------------------------------------------------------------


def _number(kind: type[int] | type[float], text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def _positive_int(text: str) -> int:
    value: int = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value: float = _number(float, text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value: float = _number(float, text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be zero or a positive number, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value: int = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, got {value}")
    return value


DESCRIPTION = """\
Run an IoT fleet through the producer into a local Kinesis, then read the stream back and
prove that every acknowledged record is in it.

Starts the emulator (per-shard limits on: 1000 records/s, 1 MiB/s) and creates the stream,
runs the devices through the producer with live progress (readings/s, per-shard MiB/s against
the limit, throttled, retried, p50/p99 put latency), then reads every shard back,
deaggregates, and prints the verdict. Exit status 0 when every acknowledged record is in the
stream, 1 when any is missing (or something nobody put is there).

--chaos runs the same fleet for 60 s while things go wrong: a throttle storm on one shard, a
hot device, a shard split and a burst of connection resets, each announced as it happens; the
verdict is the same. --plot draws the run second by second.
"""

EPILOG = """\
examples:
  anykpl demo                              # 30 s, 5,000 devices, 4 shards, asyncio
  anykpl demo --backend trio --short       # 5 s on trio
  anykpl demo --devices 20000 --rate 0.5 --shards 8
  anykpl demo --no-aggregation             # the 1000 records/s per shard limit binds
  anykpl demo --chaos                      # 60 s of trouble: storm, hot key, split, resets
  anykpl demo --chaos --plot chaos.png     # and a picture of it
  anykpl demo --endpoint http://127.0.0.1:4567 --stream other
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (the ``anykpl demo`` subcommand's parser), and
    its description and examples for ``--help``."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--duration",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="how long the devices send (default 30; 5 with --short)",
    )
    workload.add_argument(
        "--devices",
        type=_positive_int,
        default=5000,
        metavar="N",
        help="number of devices, one partition key each (default 5000)",
    )
    workload.add_argument(
        "--rate",
        type=_positive_float,
        default=0.8,
        metavar="PER_SECOND",
        help="readings per device per second (default 0.8: 4,000 readings/s from 5,000 devices)",
    )
    workload.add_argument(
        "--burst-every",
        type=_non_negative_float,
        default=None,
        metavar="SECONDS",
        help=f"seconds between bursts, in which {BURST_FRACTION * 100:.0f}%% of the devices send "
        "alert readings at once; 0 for none (default 10; 2 with --short)",
    )
    workload.add_argument(
        "--burst-size",
        type=_non_negative_int,
        default=5,
        metavar="N",
        help="alert readings per bursting device (default 5)",
    )
    workload.add_argument(
        "--short",
        action="store_true",
        help="a quick run for CI: --duration 5 --burst-every 2 unless given",
    )
    workload.add_argument(
        "--chaos",
        action="store_true",
        help="while the devices send, a throttle storm on one shard, a hot device, a shard "
        "split and a burst of connection resets, each announced as it happens (the emulator "
        "only; default duration 60 s)",
    )
    workload.add_argument(
        "--no-aggregation",
        dest="aggregation",
        action="store_false",
        help="send every reading as its own Kinesis record: the shards' 1000 records/s limit "
        "then binds instead of 1 MiB/s",
    )
    target = parser.add_argument_group("where to")
    target.add_argument(
        "--shards",
        type=_positive_int,
        default=4,
        metavar="N",
        help="shards of the stream the demo creates (default 4)",
    )
    target.add_argument(
        "--stream",
        default="demo",
        help="stream name (default demo)",
    )
    target.add_argument(
        "--endpoint",
        default=None,
        metavar="URL",
        help="use this Kinesis endpoint instead of starting the emulator ('aws' for the "
        "service's own endpoint); the stream is created if it does not exist",
    )
    target.add_argument(
        "--region",
        default=None,
        help="AWS region (default us-east-1, or botocore's configured region with --endpoint)",
    )
    tls = target.add_mutually_exclusive_group()
    tls.add_argument(
        "--ca-bundle",
        default=None,
        metavar="PATH",
        help="with --endpoint: check the endpoint's TLS certificate against the CA "
        "certificates in this PEM file (default: botocore's AWS_CA_BUNDLE or the profile's "
        "ca_bundle, else certifi's)",
    )
    tls.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="with --endpoint: do not check the endpoint's TLS certificate (a test endpoint "
        "with a self-signed certificate; never against AWS)",
    )
    running = parser.add_argument_group("running")
    running.add_argument(
        "--backend",
        choices=("asyncio", "trio"),
        default="asyncio",
        help="the event loop the producer runs on (default asyncio)",
    )
    running.add_argument(
        "--progress",
        choices=("auto", "live", "plain", "off"),
        default="auto",
        help="live table (needs rich and a terminal), plain lines, or nothing; "
        "auto picks live on a terminal and plain elsewhere",
    )
    running.add_argument(
        "-q",
        "--quiet",
        dest="progress",
        action="store_const",
        const="off",
        help="no progress, only the summary and the verdict (same as --progress off)",
    )
    running.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed for the workload's random choices",
    )
    running.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="draw the run second by second into FILE (.png, .svg or .pdf): each shard's rate "
        "against its ceiling, the backlog, throttles, retries and the chaos events (needs "
        "matplotlib: pip install 'anykpl[bench]')",
    )
    running.add_argument(
        "--json",
        action="store_true",
        help="print the results as one JSON document on stdout; the report and plain "
        "progress lines go to stderr",
    )


def workload_from(args: argparse.Namespace) -> Workload:
    """The :class:`Workload` the parsed options ask for (``--short`` fills the unset ones)."""
    if args.duration is not None:
        duration = args.duration
    else:
        duration = 5.0 if args.short else CHAOS_DURATION if args.chaos else 30.0
    burst_every = (
        args.burst_every if args.burst_every is not None else (2.0 if args.short else 10.0)
    )
    return Workload(
        devices=args.devices,
        rate=args.rate,
        duration=duration,
        burst_every=burst_every,
        burst_size=args.burst_size,
        aggregation=args.aggregation,
        run_id=os.urandom(4).hex(),
    )


# -- the run ------------------------------------------------------------------------------


def _rich_console() -> Any:
    """A ``rich`` console on stdout, or None when rich is not installed."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(highlight=False)


@contextmanager
def _progress_view(
    mode: str, console: Any, title: str, file: TextIO | None = None
) -> Iterator[ProgressView]:
    """The view ``--progress`` asks for: live needs rich and a terminal, auto falls back.

    (The view classes are imported under private names: picking one is this command's business,
    not part of the package's names.)"""
    if mode == "off":
        yield _NoView()
        return
    live_possible = console is not None and console.is_terminal
    if mode == "live" and not live_possible:
        why = "rich is not installed" if console is None else "stdout is not a terminal"
        print(f"(no live view: {why}; printing plain progress lines)", file=file, flush=True)
    if mode in ("auto", "live") and live_possible:
        from rich.live import Live

        with Live(console=console, auto_refresh=False, transient=False) as live:
            yield _LiveView(live, title)
        return
    yield _PlainView(lambda line: print(line, file=file, flush=True))


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options; returns the exit status (0: nothing lost, 1: records
    missing or unexpected, 130: interrupted)."""
    if args.json:
        # stdout is for the document alone: everything else is plain lines on stderr
        console, say = None, Printer(None, sys.stderr)
    else:
        console = _rich_console()
        say = Printer(console)
    try:
        return _run(args, console, say)
    except KeyboardInterrupt:
        say()
        say("interrupted; nothing was checked", "yellow")
        return 130


def _run(args: argparse.Namespace, console: Any, say: Printer) -> int:
    import anyio

    workload = workload_from(args)
    rng = random.Random(args.seed)
    if args.chaos and args.endpoint is not None:
        raise SystemExit("anykpl demo: --chaos needs the emulator the demo starts (no --endpoint)")
    if args.plot is not None:
        _check_plot_path(args.plot)
    with unverified_quietly(args.verify), started_target(args, say) as target:
        where = "the emulator" if target.emulator else (target.endpoint_url or "AWS")
        title = (
            f"anykpl demo · {args.backend} · stream {target.stream} on {where} · "
            f"{workload.devices:,} devices"
        )
        say(f"{workload.describe()}, on {args.backend}")
        emulator_stats = (
            EmulatorStats(target.endpoint_url) if target.emulator and target.endpoint_url else None
        )
        chaos = (
            Chaos(target.stream, args.shards, workload.devices, workload.duration)
            if args.chaos
            else None
        )
        if chaos is not None:
            say(chaos.describe())
        timeline = Timeline(target.stream)
        out = sys.stderr if args.json else None
        with _progress_view(args.progress, console, title, out) as view:
            report = anyio.run(
                lambda: produce(
                    target,
                    workload,
                    view,
                    rng=rng,
                    emulator_stats=emulator_stats,
                    chaos=chaos,
                    timeline=timeline,
                ),
                backend=args.backend,
            )
        final_stats = emulator_stats.fetch() if emulator_stats is not None else None
        if final_stats is not None:
            timeline.finish(final_stats, report.elapsed)
        report_run(say, report, final_stats, target.stream)
        if chaos is not None:
            timeline.events = list(chaos.happened)
            say()
            say("chaos, as it happened:")
            for at, text in chaos.happened:
                say(f"  {at:5.1f} s  {text}")

        say()
        say(f"reading stream {target.stream} back from TRIM_HORIZON and deaggregating")
        prefix = run_prefix(workload.run_id)
        client = botocore_client(target)
        try:
            found, left_out = readback.count_user_records(
                client,
                target.stream,
                keep=lambda _key, data: data.startswith(prefix),
                pace=0.0 if target.emulator else 0.2,
            )
        finally:
            client.close()
    verdict = readback.judge(report.tally.acknowledged_records, found, report.tally.failed_records)
    report_verdict(say, verdict, sum(found.values()), left_out)
    if args.plot is not None:
        command = "anykpl demo --chaos" if args.chaos else "anykpl demo"
        try:
            plot(
                timeline.to_json(),
                args.plot,
                f"{command} · {args.backend} · {workload.devices:,} devices · "
                f"{'PASS' if verdict.ok else 'FAIL'}",
            )
        except OSError as exc:  # the verdict stands; the picture is what failed
            say(f"could not draw the timeline in {args.plot}: {exc}", "red")
        else:
            say(f"the timeline is drawn in {args.plot}")
    if args.json:
        document = _document(args, workload, target.stream, report, verdict, sum(found.values()))
        document["timeline"] = timeline.to_json()
        json.dump(document, sys.stdout, indent=2)
        print()
    return verdict.exit_code


#: what --plot can write
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _check_plot_path(path: str) -> None:
    """Refuse before the run a --plot that could not be written after it."""
    if (why := matplotlib_missing()) is not None:
        raise SystemExit(f"anykpl demo: {why}")
    if os.path.splitext(path)[1].lower() not in PLOT_SUFFIXES:
        raise SystemExit(
            f"anykpl demo: --plot {path}: the file's name must end in "
            f"{', '.join(PLOT_SUFFIXES[:-1])} or {PLOT_SUFFIXES[-1]}"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SystemExit(f"anykpl demo: --plot {path}: no directory {folder}")
    if os.path.isdir(path) or not os.access(folder, os.W_OK):
        raise SystemExit(f"anykpl demo: --plot {path}: cannot write a file there")


def _document(
    args: argparse.Namespace,
    workload: Workload,
    stream: str,
    report: RunReport,
    verdict: readback.Verdict,
    read_back: int,
) -> dict[str, Any]:
    """What ``--json`` prints: the run's settings, the producer's figures and the verdict."""
    tally = report.tally
    latencies = tally.latencies
    return {
        "command": "anykpl demo",
        "backend": args.backend,
        "stream": stream,
        "chaos": bool(args.chaos),
        "workload": {
            "devices": workload.devices,
            "rate": workload.rate,
            "duration": workload.duration,
            "burst_every": workload.burst_every,
            "burst_size": workload.burst_size,
            "aggregation": workload.aggregation,
        },
        "elapsed_seconds": round(report.elapsed, 3),
        "offered": tally.offered_count,
        "acknowledged": tally.acknowledged_count,
        "acknowledged_bytes": tally.acknowledged_bytes,
        "failed": tally.failed_count,
        "failed_by_code": dict(tally.failures_by_code),
        "errors_by_code": dict(report.errors_by_code),
        "throttled": report.throttled,
        "retried": report.retried,
        "put_latency_ms": {
            "p50": _ms(latencies.percentile(50)),
            "p99": _ms(latencies.percentile(99)),
        },
        "read_back": {
            "user_records": read_back,
            "present": verdict.present,
            "missing": verdict.missing,
            "duplicates": verdict.duplicates,
            "failed_present": verdict.failed_present,
            "unexpected": verdict.unexpected,
        },
        "ok": verdict.ok,
        "exit_code": verdict.exit_code,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)
