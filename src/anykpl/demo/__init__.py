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

Layout: the workload (:class:`DeviceGroup`) and the bookkeeping (:class:`Tally`,
:class:`LatencyHistogram`, :func:`shard_rates_from_emulator`) are synchronous and take the
time as an argument; the async part (:func:`produce`) only moves readings into the producer and
results into the tally. Reading back and judging live in :mod:`anykpl.demo.readback`.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import math
import os
import random
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from .. import errors
from .._limits import SHARD_BYTES_PER_SECOND, SHARD_RECORDS_PER_SECOND
from . import readback

if TYPE_CHECKING:
    from anykpl import PendingRecord, Producer

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

#: Devices per putting task: one task per group keeps the task count small (50 for 5,000
#: devices) while every group still puts concurrently with the others.
GROUP_SIZE = 100
#: The share of devices that send alert readings in a burst.
BURST_FRACTION = 0.1
#: A group wakes at most this often; readings that fall due in between go out together.
TICK = 0.02
#: An acknowledging task lets the others run after this many readings in a row.
ACKNOWLEDGE_BATCH = 256
#: How often the live view refreshes, and the window its rates and percentiles cover.
REFRESH_EVERY = 0.5
RATE_WINDOW = 2.0
#: How often the plain (non-terminal) progress prints a line.
PLAIN_EVERY = 2.0
#: Credentials for the emulator, which accepts any.
DEMO_CREDENTIALS = {"aws_access_key_id": "demo", "aws_secret_access_key": "demo"}
MIB = 1024 * 1024


# -- options ------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be zero or a positive number, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
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
"""

EPILOG = """\
examples:
  anykpl demo                              # 30 s, 5,000 devices, 4 shards, asyncio
  anykpl demo --backend trio --short       # 5 s on trio
  anykpl demo --devices 20000 --rate 0.5 --shards 8
  anykpl demo --no-aggregation             # the 1000 records/s per shard limit binds
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


@dataclass(frozen=True)
class Workload:
    """What the devices send.

    Attributes:
        devices: number of devices; device 42's partition key is ``dev-00042``.
        rate: readings per device per second (each device at a steady cadence, with a random
            phase so the fleet's readings spread evenly over time).
        duration: seconds the devices send.
        burst_every: seconds between bursts (0: no bursts). Bursts fall halfway through each
            period: at 5 s, 15 s, 25 s for 10 s.
        burst_size: alert readings each bursting device sends at once.
        aggregation: whether the producer aggregates.
        run_id: tags every reading, so that a stream holding earlier runs can be read back.
    """

    devices: int = 5000
    rate: float = 0.8
    duration: float = 30.0
    burst_every: float = 10.0
    burst_size: int = 5
    aggregation: bool = True
    run_id: str = "00000000"

    @property
    def steady_rate(self) -> float:
        """Readings per second from the steady cadence alone."""
        return self.devices * self.rate

    def describe(self) -> str:
        """One line for the top of the demo's output."""
        bursts = (
            f" + every {self.burst_every:g} s {BURST_FRACTION:.0%} of them send "
            f"{self.burst_size} alerts"
            if self.burst_every and self.burst_size
            else ""
        )
        return (
            f"{self.devices:,} devices × {self.rate:g} readings/s "
            f"(≈{self.steady_rate:,.0f} readings/s){bursts}, for {self.duration:g} s"
        )


def workload_from(args: argparse.Namespace) -> Workload:
    """The :class:`Workload` the parsed options ask for (``--short`` fills the unset ones)."""
    duration = args.duration if args.duration is not None else (5.0 if args.short else 30.0)
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


# -- the devices --------------------------------------------------------------------------


def device_name(index: int) -> str:
    """The partition key of device ``index``: ``dev-00042``."""
    return f"dev-{index:05d}"


class DeviceGroup:
    """The readings of a group of devices: a steady cadence per device, plus bursts.

    Synchronous and clock-free: :meth:`take_due` is given the seconds since the start and
    returns what fell due by then, and :meth:`next_due` says when to ask again. A reading is
    ``(partition_key, data)`` with data like::

        {"run":"1f2e3d4c","device":"dev-00042","seq":17,"ts":1718000000.123,
         "temp":21.37,"hum":40.2,"kind":"reading"}

    ``seq`` counts each device's readings from 0, so ``(device, seq)`` names a reading. A
    device that falls behind (the producer pushing back) catches up: every reading due is
    sent, none is skipped.
    """

    def __init__(
        self, devices: Sequence[int], workload: Workload, rng: random.Random | None = None
    ) -> None:
        self._workload = workload
        self._rng = rng or random.Random()
        self._devices = list(devices)
        self._names = {index: device_name(index) for index in self._devices}
        self._interval = 1.0 / workload.rate
        self._seq = dict.fromkeys(self._devices, 0)
        # a room temperature and humidity per device, so the series look like sensors
        self._base = {
            index: (self._rng.uniform(18.0, 26.0), self._rng.uniform(30.0, 60.0))
            for index in self._devices
        }
        self._prefix = run_prefix(workload.run_id).decode() + '"device":"'
        self._due = [(self._rng.uniform(0.0, self._interval), index) for index in self._devices]
        heapq.heapify(self._due)
        bursts = workload.burst_every > 0 and workload.burst_size > 0
        self._next_burst = workload.burst_every / 2 if bursts else math.inf
        self._bursting = max(1, round(len(self._devices) * BURST_FRACTION))

    def next_due(self) -> float:
        """Seconds since the start at which the next reading falls due."""
        steady = self._due[0][0] if self._due else math.inf
        return min(steady, self._next_burst)

    def take_due(self, elapsed: float, wall_time: float) -> list[tuple[str, bytes]]:
        """Every reading due by ``elapsed`` seconds since the start, stamped ``wall_time``."""
        readings: list[tuple[str, bytes]] = []
        due = self._due
        while due and due[0][0] <= elapsed:
            when, index = due[0]
            readings.append(self._reading(index, wall_time, elapsed, "reading"))
            heapq.heapreplace(due, (when + self._interval, index))
        if elapsed >= self._next_burst:
            for index in self._rng.sample(self._devices, self._bursting):
                for _ in range(self._workload.burst_size):
                    readings.append(self._reading(index, wall_time, elapsed, "alert"))
            self._next_burst += self._workload.burst_every
        return readings

    def _reading(
        self, index: int, wall_time: float, elapsed: float, kind: str
    ) -> tuple[str, bytes]:
        name = self._names[index]
        seq = self._seq[index]
        self._seq[index] = seq + 1
        base_temperature, base_humidity = self._base[index]
        swing = math.sin(elapsed / 60.0 * math.tau + index)
        temperature = base_temperature + 1.5 * swing + self._rng.uniform(-0.1, 0.1)
        if kind == "alert":
            temperature += 8.0
        humidity = base_humidity - 3.0 * swing
        data = (
            f'{self._prefix}{name}","seq":{seq},"ts":{wall_time:.3f},'
            f'"temp":{temperature:.2f},"hum":{humidity:.1f},"kind":"{kind}"}}'
        )
        return name, data.encode()


def run_prefix(run_id: str) -> bytes:
    """The bytes every reading of run ``run_id`` starts with."""
    return f'{{"run":"{run_id}",'.encode()


# -- bookkeeping --------------------------------------------------------------------------


class LatencyHistogram:
    """Latencies in logarithmic buckets 1 % wide: percentiles of any number of samples in a
    few hundred integers, within 1 % of the exact value."""

    _GROWTH = math.log(1.01)

    def __init__(self) -> None:
        self._buckets: Counter[int] = Counter()
        self.count = 0
        self.max = 0.0

    def add(self, seconds: float) -> None:
        bucket = math.ceil(math.log(max(seconds, 1e-6)) / self._GROWTH)
        self._buckets[bucket] += 1
        self.count += 1
        if seconds > self.max:
            self.max = seconds

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0..100) in seconds (a bucket's upper edge), or None."""
        if not self.count:
            return None
        rank = max(1, math.ceil(self.count * q / 100))
        seen = 0
        for bucket in sorted(self._buckets):
            seen += self._buckets[bucket]
            if seen >= rank:
                return min(math.exp(bucket * self._GROWTH), self.max)
        return self.max  # pragma: no cover (the ranks add up to count)


def percentile(samples: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, nearest rank) of ``samples``, or None when empty."""
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)]


@dataclass(frozen=True)
class ShardRate:
    """One shard's write rate over the last few whole seconds, against its limits.

    Attributes:
        shard_id: the shard.
        records_per_second: records per second; Kinesis records (what the service limits)
            when measured by the emulator, user records when measured by the producer.
        bytes_per_second: data + partition key bytes per second.
        throttled: records throttled on this shard so far.
        limit_records: the shard's record limit, or None (not limited, or not comparable).
        limit_bytes: the shard's byte limit, or None when not limited.
    """

    shard_id: str
    records_per_second: float
    bytes_per_second: float
    throttled: int
    limit_records: float | None
    limit_bytes: float | None


def shard_rates_from_emulator(
    stats: Mapping[str, Any], stream: str, window: int = 2
) -> list[ShardRate]:
    """Each open shard's rate of ``stream`` over the last ``window`` whole seconds, from the
    emulator's ``stats()`` (see docs/emulator.md)."""
    last = int(stats["uptime"]) - 1  # the second in progress is not whole yet
    first = last - window + 1
    rates = []
    for shard in stats["shards"]:
        if shard["stream"] != stream or not shard.get("open", True):
            continue
        records = stored = 0
        for second, accepted_records, accepted_bytes, *_ in shard["per_second"]:
            if first <= second <= last:
                records += accepted_records
                stored += accepted_bytes
        span = max(1, min(window, last + 1))
        rates.append(
            ShardRate(
                shard_id=shard["shard_id"],
                records_per_second=records / span,
                bytes_per_second=stored / span,
                throttled=int(shard["throttled_records"]),
                limit_records=shard.get("limit_records"),
                limit_bytes=shard.get("limit_bytes"),
            )
        )
    return sorted(rates, key=lambda rate: rate.shard_id)


class Tally:
    """What happened to the readings: counts, latencies, per-shard throughput.

    Fed by the putting tasks (:meth:`offered`, :meth:`acknowledged`, :meth:`failed`) with
    times in seconds since the start; read by the progress view and the final report. Keeps
    every acknowledged and failed reading for the read-back check.
    """

    def __init__(self) -> None:
        self.offered_count = 0
        self.acknowledged_records: set[tuple[str, bytes]] = set()
        self.failed_records: set[tuple[str, bytes]] = set()
        self.failures_by_code: Counter[str] = Counter()
        self.latencies = LatencyHistogram()
        self.acknowledged_bytes = 0
        self.shard_totals: dict[str, list[int]] = {}  # shard -> [user records, bytes]
        self._recent: deque[tuple[float, float]] = deque()  # (acknowledged at, latency)
        self._shard_seconds: dict[str, dict[int, list[int]]] = {}
        self._samples: deque[tuple[float, int, int]] = deque([(0.0, 0, 0)])

    @property
    def acknowledged_count(self) -> int:
        return len(self.acknowledged_records)

    @property
    def failed_count(self) -> int:
        return len(self.failed_records)

    def offered(self, count: int) -> None:
        """``count`` more readings were handed to the producer."""
        self.offered_count += count

    def acknowledged(
        self, record: tuple[str, bytes], shard_id: str | None, latency: float, at: float
    ) -> None:
        """``record`` was put into ``shard_id``, ``latency`` seconds after the call, ``at``
        seconds after the start."""
        self.acknowledged_records.add(record)
        self.latencies.add(latency)
        self._recent.append((at, latency))
        size = len(record[0]) + len(record[1])  # device names are ASCII
        self.acknowledged_bytes += size
        shard = shard_id or "?"
        totals = self.shard_totals.setdefault(shard, [0, 0])
        totals[0] += 1
        totals[1] += size
        second = self._shard_seconds.setdefault(shard, {}).setdefault(int(at), [0, 0])
        second[0] += 1
        second[1] += size

    def failed(self, record: tuple[str, bytes], code: str | None) -> None:
        """``record`` failed for good, with error code ``code``."""
        self.failed_records.add(record)
        self.failures_by_code[code or "unknown"] += 1

    def sample_rates(self, now: float, window: float = RATE_WINDOW) -> tuple[float, float]:
        """Note the counts at ``now``; return (offered, acknowledged) readings per second since
        the oldest note in the last ``window`` seconds (or the start)."""
        samples = self._samples
        samples.append((now, self.offered_count, self.acknowledged_count))
        while len(samples) > 2 and samples[1][0] <= now - window:
            samples.popleft()
        then, offered, acknowledged = samples[0]
        span = now - then
        if span <= 0:
            return 0.0, 0.0
        offered_rate = (self.offered_count - offered) / span
        acknowledged_rate = (self.acknowledged_count - acknowledged) / span
        return offered_rate, acknowledged_rate

    def recent_percentiles(
        self, now: float, window: float = RATE_WINDOW
    ) -> tuple[float | None, float | None]:
        """p50 and p99 latency of the records acknowledged in the last ``window`` seconds."""
        recent = self._recent
        while recent and recent[0][0] < now - window:
            recent.popleft()
        latencies = [latency for _, latency in recent]
        return percentile(latencies, 50), percentile(latencies, 99)

    def shard_rates(self, now: float, window: int = 2) -> list[ShardRate]:
        """Each shard's acknowledged user records and bytes per second over the last
        ``window`` whole seconds, as the producer saw them (used without the emulator)."""
        last = int(now) - 1
        rates = []
        for shard, seconds in sorted(self._shard_seconds.items()):
            for second in [s for s in seconds if s < last - 10]:
                del seconds[second]  # keep a few seconds, not the whole run
            records = stored = 0
            for second in range(last - window + 1, last + 1):
                row = seconds.get(second)
                if row:
                    records += row[0]
                    stored += row[1]
            span = max(1, min(window, last + 1))
            rates.append(
                ShardRate(shard, records / span, stored / span, 0, None, SHARD_BYTES_PER_SECOND)
            )
        return rates


# -- progress views -----------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """One refresh of the progress view.

    Attributes:
        elapsed: seconds since the devices started.
        duration: seconds the devices send.
        offered_rate: readings per second the devices handed to the producer, lately.
        acknowledged_rate: readings per second acknowledged, lately.
        acknowledged: readings acknowledged so far.
        failed: readings that failed so far.
        outstanding: readings admitted and not yet terminal.
        throttled: Kinesis records throttled so far (the producer's count).
        retried: user records retried so far.
        p50: median put latency of the readings acknowledged lately, in seconds.
        p99: 99th percentile of the same.
        shards: each shard's rate lately.
        measured_by: ``emulator`` or ``producer``, who measured :attr:`shards`.
        finished: whether this is the last refresh.
    """

    elapsed: float
    duration: float
    offered_rate: float
    acknowledged_rate: float
    acknowledged: int
    failed: int
    outstanding: int
    throttled: int
    retried: int
    p50: float | None
    p99: float | None
    shards: list[ShardRate] = field(default_factory=list)
    measured_by: str = "producer"
    finished: bool = False


class ProgressView(Protocol):
    """Shows :class:`Progress` as it comes, twice a second."""

    def update(self, progress: Progress) -> None: ...


class _NoView:
    def update(self, progress: Progress) -> None:
        pass


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _share(value: float, limit: float | None) -> str:
    return "" if not limit else f"{value / limit:4.0%}"


class _PlainView:
    """A line every :data:`PLAIN_EVERY` seconds, for logs and CI."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write
        self._next = PLAIN_EVERY

    def update(self, progress: Progress) -> None:
        if progress.elapsed < self._next and not progress.finished:
            return
        self._next = progress.elapsed + PLAIN_EVERY - REFRESH_EVERY / 2
        shards = " ".join(f"{rate.bytes_per_second / MIB:.2f}" for rate in progress.shards)
        records = " ".join(f"{rate.records_per_second:,.0f}" for rate in progress.shards)
        self._write(
            f"[{progress.elapsed:5.1f} s] offered {progress.offered_rate:,.0f}/s  "
            f"acknowledged {progress.acknowledged_rate:,.0f}/s ({progress.acknowledged:,})  "
            f"failed {progress.failed:,}  throttled {progress.throttled:,}  "
            f"retried {progress.retried:,}  p50 {_ms(progress.p50)}  p99 {_ms(progress.p99)}  "
            f"| per shard MiB/s: {shards or '-'}, records/s: {records or '-'}"
        )


def _bar(share: float, width: int = 20) -> tuple[str, str]:
    """A text bar for ``share`` of a limit and its colour."""
    filled = min(width, round(share * width))
    colour = "green" if share < 0.8 else "yellow" if share < 1.0 else "red"
    return "█" * filled + "░" * (width - filled), colour


class _LiveView:
    """A ``rich`` live table, redrawn on every update (about twice a second)."""

    def __init__(self, live: Any, title: str) -> None:
        self._live = live
        self._title = title

    def update(self, progress: Progress) -> None:
        self._live.update(self.render(progress), refresh=True)

    def render(self, progress: Progress) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        done = min(1.0, progress.elapsed / progress.duration)
        bar, _ = _bar(done, 40)
        if progress.finished:
            state = " done"
        elif progress.elapsed >= progress.duration:
            state = " waiting for the last results"
        else:
            state = ""
        header = Text.assemble(
            (self._title, "bold"),
            "\n",
            (bar, "cyan"),
            f" {progress.elapsed:5.1f} s / {progress.duration:g} s{state}",
        )
        figures = Table.grid(padding=(0, 2))
        figures.add_column(style="dim")
        figures.add_column(justify="right")
        figures.add_column(style="dim")
        figures.add_column(justify="right")
        figures.add_row(
            "readings offered",
            f"{progress.offered_rate:,.0f}/s",
            "acknowledged",
            f"{progress.acknowledged:,}",
        )
        figures.add_row(
            "readings acknowledged",
            f"{progress.acknowledged_rate:,.0f}/s",
            "outstanding",
            f"{progress.outstanding:,}",
        )
        figures.add_row("put latency p50", _ms(progress.p50), "failed", f"{progress.failed:,}")
        figures.add_row(
            "put latency p99", _ms(progress.p99), "throttled", f"{progress.throttled:,}"
        )
        figures.add_row("", "", "retried", f"{progress.retried:,}")
        kind = "Kinesis records/s" if progress.measured_by == "emulator" else "user records/s"
        shards = Table(
            title=f"per shard, last {RATE_WINDOW:g} s (measured by the {progress.measured_by})",
            title_justify="left",
            expand=False,
        )
        shards.add_column("shard")
        shards.add_column("MiB/s", justify="right")
        shards.add_column("of the byte limit")
        shards.add_column(kind, justify="right")
        shards.add_column("throttled", justify="right")
        for rate in progress.shards:
            if rate.limit_bytes:
                share = rate.bytes_per_second / rate.limit_bytes
                shard_bar, colour = _bar(share)
                against = Text.assemble((shard_bar, colour), f" {share:4.0%}")
            else:
                against = Text("no limit", "dim")
            records = f"{rate.records_per_second:,.0f}"
            if rate.limit_records:
                records += f" ({_share(rate.records_per_second, rate.limit_records).strip()})"
            shards.add_row(
                rate.shard_id,
                f"{rate.bytes_per_second / MIB:.3f}",
                against,
                records,
                f"{rate.throttled:,}",
            )
        return Group(header, Text(""), figures, Text(""), shards)


def _rich_console() -> Any:
    """A ``rich`` console on stdout, or None when rich is not installed."""
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(highlight=False)


@contextmanager
def _progress_view(mode: str, console: Any, title: str) -> Iterator[ProgressView]:
    """The view ``--progress`` asks for: live needs rich and a terminal, auto falls back."""
    if mode == "off":
        yield _NoView()
        return
    live_possible = console is not None and console.is_terminal
    if mode == "live" and not live_possible:
        why = "rich is not installed" if console is None else "stdout is not a terminal"
        print(f"(no live view: {why}; printing plain progress lines)", flush=True)
    if mode in ("auto", "live") and live_possible:
        from rich.live import Live

        with Live(console=console, auto_refresh=False, transient=False) as live:
            yield _LiveView(live, title)
        return
    yield _PlainView(lambda line: print(line, flush=True))


# -- putting ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where the readings go.

    Attributes:
        endpoint_url: the Kinesis endpoint (None: the service's, from the region).
        region: the AWS region.
        credentials: explicit credentials, or empty for botocore's usual chain.
        stream: the stream name.
        emulator: whether the endpoint is the emulator this demo started (its statistics can
            be asked for).
        verify_certificate: whether to check the endpoint's TLS certificate (``--no-verify``
            turns it off).
        ca_bundle: the PEM file of CA certificates to check it with (``--ca-bundle``), or
            None for botocore's chain.
    """

    endpoint_url: str | None
    region: str
    credentials: Mapping[str, str]
    stream: str
    emulator: bool
    verify_certificate: bool = True
    ca_bundle: str | None = None

    @property
    def verify(self) -> bool | str | None:
        """botocore's ``verify``: False, the CA bundle, or None (botocore's chain)."""
        return self.ca_bundle if self.verify_certificate else False


@dataclass
class RunReport:
    """What :func:`produce` hands back: the tally and the producer's last counters."""

    tally: Tally
    elapsed: float
    throttled: int
    retried: int
    errors_by_code: Mapping[str, int]
    throttled_by_shard: Mapping[str, int]


class _EmulatorStats:
    """The emulator's latest ``stats()``, polled from a worker thread while the demo runs."""

    def __init__(self, url: str) -> None:
        from anykpl.emulator import EmulatorClient

        self._client = EmulatorClient(url)
        self.latest: Mapping[str, Any] | None = None

    def fetch(self) -> Mapping[str, Any]:
        stats: Mapping[str, Any] = self._client.stats()
        return stats

    async def poll(self, period: float) -> None:
        """Refresh :attr:`latest` every ``period`` seconds. A failed call leaves it None, and
        the view falls back to the producer's own measurements until a call succeeds."""
        import anyio.to_thread

        while True:
            try:
                self.latest = await anyio.to_thread.run_sync(self.fetch)
            except Exception:
                self.latest = None
            await anyio.sleep(period)


def _throttled_by_shard(statistics: Any, stream: str) -> dict[str, int]:
    """Throttled Kinesis records per (predicted) shard of ``stream``, from the producer's
    metrics."""
    return {
        key.shard: int(count)
        for key, count in statistics.metrics.items()
        if key.name == "ErrorsByCode"
        and key.error_code == errors.THROTTLED
        and key.stream == stream
        and key.shard is not None
    }


#: What a putting task hands its acknowledging task: when ``submit`` was called, when it
#: returned, the reading, and its handle.
_InFlight = tuple[float, float, str, bytes, "PendingRecord"]


def _throttled_and_retried(statistics: Any) -> tuple[int, int]:
    """Throttled Kinesis records and retried user records, from ``producer.statistics()``."""
    from anykpl import MetricKey

    throttled = int(statistics.errors_by_code.get(errors.THROTTLED, 0))
    retried = int(statistics.metrics.get(MetricKey("RetriesPerRecord"), 0))
    return throttled, retried


async def produce(
    target: Target,
    workload: Workload,
    view: ProgressView,
    *,
    rng: random.Random | None = None,
    emulator_stats: _EmulatorStats | None = None,
) -> RunReport:
    """Run ``workload`` through a :class:`~anykpl.Producer` into ``target``; return the tally.

    One task per :data:`GROUP_SIZE` devices submits the readings as they fall due and hands
    each :class:`~anykpl.PendingRecord` to the group's acknowledging task, which awaits them in
    order. A record's put latency is measured from the call to ``submit`` to the end of its
    last attempt: the admission wait plus the sum of its attempts' ``delay`` and ``duration``,
    which add up to the time from admission to the end of the final PutRecords call.
    """
    import anyio
    import anyio.lowlevel
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from anykpl import Producer, ProducerConfig

    rng = rng or random.Random()
    tally = Tally()
    config = ProducerConfig(
        region=target.region,
        endpoint_url=target.endpoint_url,
        aggregation_enabled=workload.aggregation,
        aws_access_key_id=target.credentials.get("aws_access_key_id"),
        aws_secret_access_key=target.credentials.get("aws_secret_access_key"),
        verify_certificate=target.verify_certificate,
        ca_bundle=target.ca_bundle,
    )
    indexes = list(range(workload.devices))
    groups = [
        DeviceGroup(indexes[i : i + GROUP_SIZE], workload, random.Random(rng.random()))
        for i in range(0, workload.devices, GROUP_SIZE)
    ]
    stream = target.stream
    clock = anyio.current_time

    # Per-record times come from perf_counter: only differences and offsets from the start
    # are used, and anyio.current_time (which looks the backend up on every call) would cost
    # more than the rest of the demo's work per reading. The schedule uses the loop's clock.
    perf_counter = time.perf_counter

    async with Producer(config) as producer:
        start = clock()
        perf_start = perf_counter()

        async def emit(group: DeviceGroup, handles: MemoryObjectSendStream[_InFlight]) -> None:
            async with handles:
                while True:
                    wake = min(group.next_due(), workload.duration)
                    await anyio.sleep_until(start + wake)
                    elapsed = clock() - start
                    if elapsed >= workload.duration:
                        return
                    readings = group.take_due(elapsed, time.time())
                    tally.offered(len(readings))
                    called = perf_counter()
                    for key, data in readings:
                        pending = await producer.submit(stream, data, partition_key=key)
                        admitted = perf_counter()
                        handles.send_nowait((called, admitted, key, data, pending))
                        called = admitted  # the next call starts as this one returns
                    # at most one wake-up per tick, however the readings fall
                    await anyio.sleep_until(start + elapsed + TICK)

        async def acknowledge(handles: MemoryObjectReceiveStream[_InFlight]) -> None:
            # Takes what is queued without waiting and reads done records without awaiting
            # them: a checkpoint per reading would cost an event loop turn each. It yields
            # every ACKNOWLEDGE_BATCH readings instead.
            async with handles:
                taken = 0
                while True:
                    try:
                        called, admitted, key, data, pending = handles.receive_nowait()
                    except anyio.WouldBlock:
                        try:
                            called, admitted, key, data, pending = await handles.receive()
                        except anyio.EndOfStream:
                            return
                    except anyio.EndOfStream:
                        return
                    try:
                        result = pending.result() if pending.done() else await pending.wait()
                    except errors.RecordFailedError as exc:
                        tally.failed((key, data), exc.error_code)
                        continue
                    latency = admitted - called
                    for attempt in result.attempts:
                        latency += attempt.delay + attempt.duration
                    tally.acknowledged(
                        (key, data), result.shard_id, latency, called + latency - perf_start
                    )
                    taken += 1
                    if taken % ACKNOWLEDGE_BATCH == 0:
                        await anyio.lowlevel.checkpoint()

        async def show() -> None:
            while True:
                elapsed = clock() - start
                view.update(_progress(producer, tally, elapsed, workload, emulator_stats, stream))
                await anyio.sleep(REFRESH_EVERY)

        async with anyio.create_task_group() as around:
            if emulator_stats is not None:
                around.start_soon(emulator_stats.poll, REFRESH_EVERY)
            around.start_soon(show)
            async with anyio.create_task_group() as devices:
                for group in groups:
                    send, receive = anyio.create_memory_object_stream[_InFlight](math.inf)
                    devices.start_soon(emit, group, send)
                    devices.start_soon(acknowledge, receive)
            around.cancel_scope.cancel()
        elapsed = clock() - start
        view.update(
            _progress(producer, tally, elapsed, workload, emulator_stats, stream, finished=True)
        )
        statistics = producer.statistics()
    throttled, retried = _throttled_and_retried(statistics)
    return RunReport(
        tally,
        elapsed,
        throttled,
        retried,
        dict(statistics.errors_by_code),
        _throttled_by_shard(statistics, stream),
    )


def _progress(
    producer: Producer,
    tally: Tally,
    elapsed: float,
    workload: Workload,
    emulator_stats: _EmulatorStats | None,
    stream: str,
    *,
    finished: bool = False,
) -> Progress:
    statistics = producer.statistics()
    throttled, retried = _throttled_and_retried(statistics)
    offered_rate, acknowledged_rate = tally.sample_rates(elapsed)
    p50, p99 = tally.recent_percentiles(elapsed)
    window = round(RATE_WINDOW)
    if emulator_stats is not None and emulator_stats.latest is not None:
        shards = shard_rates_from_emulator(emulator_stats.latest, stream, window)
        measured_by = "emulator"
    else:
        throttled_by_shard = _throttled_by_shard(statistics, stream)
        shards = [
            replace(rate, throttled=throttled_by_shard.get(rate.shard_id, 0))
            for rate in tally.shard_rates(elapsed, window)
        ]
        measured_by = "producer"
    return Progress(
        elapsed=elapsed,
        duration=workload.duration,
        offered_rate=offered_rate,
        acknowledged_rate=acknowledged_rate,
        acknowledged=tally.acknowledged_count,
        failed=tally.failed_count,
        outstanding=statistics.outstanding_records,
        throttled=throttled,
        retried=retried,
        p50=p50,
        p99=p99,
        shards=shards,
        measured_by=measured_by,
        finished=finished,
    )


# -- the report ---------------------------------------------------------------------------


class _Printer:
    """Lines to stdout, styled through rich when it is there."""

    def __init__(self, console: Any) -> None:
        self._console = console

    def __call__(self, text: str = "", style: str | None = None) -> None:
        if self._console is None:
            print(text, flush=True)
        else:
            self._console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def _report_run(
    say: _Printer,
    report: RunReport,
    final_stats: Mapping[str, Any] | None,
    stream: str,
) -> None:
    tally = report.tally
    seconds = max(report.elapsed, 1e-9)
    latencies = tally.latencies
    say()
    say("Producer", "bold")
    say(
        f"  offered {tally.offered_count:,} readings in {report.elapsed:.1f} s; "
        f"acknowledged {tally.acknowledged_count:,} ({tally.acknowledged_count / seconds:,.0f}/s, "
        f"{tally.acknowledged_bytes / MIB:.1f} MiB), failed {tally.failed_count:,}"
    )
    for code, count in sorted(tally.failures_by_code.items()):
        say(f"    failed with {code}: {count:,}", "yellow")
    say(
        f"  put latency p50 {_ms(latencies.percentile(50))}, p99 {_ms(latencies.percentile(99))}"
        f", max {_ms(latencies.max if latencies.count else None)}"
    )
    say(
        f"  throttled Kinesis records {report.throttled:,}, retried user records {report.retried:,}"
    )
    other = {
        code: count for code, count in report.errors_by_code.items() if code != errors.THROTTLED
    }
    if other:
        say("  other errors: " + ", ".join(f"{c} {n:,}" for c, n in sorted(other.items())))
    say()
    say("Per shard", "bold")
    # With the emulator, bytes are what each shard stored (aggregated records: data plus
    # partition key, the bytes the limit counts); without it, the user records' bytes.
    emulator_rows: dict[str, Mapping[str, Any]] = {}
    if final_stats is not None:
        emulator_rows = {
            row["shard_id"]: row for row in final_stats["shards"] if row["stream"] == stream
        }
    header = f"  {'shard':<22}{'user records':>14}"
    if emulator_rows:
        header += f"{'Kinesis records':>17}{'MiB stored':>12}"
    else:
        header += f"{'MiB':>12}"
    say(header + f"{'avg MiB/s':>11}{'of limit':>10}{'throttled':>11}", "dim")
    for shard in sorted(set(tally.shard_totals) | set(emulator_rows)):
        records, stored = tally.shard_totals.get(shard, [0, 0])
        line = f"  {shard:<22}{records:>14,}"
        row = emulator_rows.get(shard)
        if row is not None:
            stored = row["accepted_bytes"]
            line += f"{row['accepted_records']:>17,}"
            throttled = row["throttled_records"]
        else:
            throttled = report.throttled_by_shard.get(shard, 0)
        per_second = stored / seconds
        say(
            f"{line}{stored / MIB:>12.2f}{per_second / MIB:>11.3f}"
            f"{per_second / SHARD_BYTES_PER_SECOND:>10.1%}{throttled:>11,}"
        )
    if final_stats is not None:
        totals = final_stats["totals"]
        say(
            f"  the emulator stored {totals['accepted_records']:,} Kinesis records "
            f"({totals['accepted_bytes'] / MIB:.1f} MiB) from {totals['requests']:,} requests "
            f"and throttled {totals['throttled_records']:,}; each shard's limits are "
            f"{SHARD_RECORDS_PER_SECOND:,} records/s and {SHARD_BYTES_PER_SECOND / MIB:g} MiB/s",
            "dim",
        )


def _report_verdict(say: _Printer, verdict: readback.Verdict, found: int, left_out: int) -> None:
    say()
    say("Read back", "bold")
    say(
        f"  read {found:,} user records of this run from the stream"
        + (f" (and {left_out:,} of earlier runs, ignored)" if left_out else "")
    )
    say(
        f"  acknowledged {verdict.acknowledged:,}: present {verdict.present:,}, "
        f"missing {verdict.missing:,}; duplicates {verdict.duplicates:,}; "
        f"unexpected {verdict.unexpected:,}"
    )
    if verdict.failed:
        say(
            f"  failed {verdict.failed:,}, of which {verdict.failed_present:,} reached the "
            "stream anyway (a failed record may have been written)"
        )
    for key, data in verdict.examples_missing:
        say(f"    missing: {key} {data.decode(errors='replace')}", "red")
    for key, data in verdict.examples_unexpected:
        say(f"    unexpected: {key} {data.decode(errors='replace')}", "red")
    say()
    if verdict.ok:
        extra = f", {verdict.duplicates:,} duplicates" if verdict.duplicates else ", no duplicates"
        say(
            f"PASS: all {verdict.acknowledged:,} acknowledged records are in the stream, "
            f"none lost{extra}.",
            "bold green",
        )
    elif verdict.acknowledged == 0:
        say("FAIL: the producer acknowledged no records.", "bold red")
    else:
        say(
            f"FAIL: {verdict.missing:,} acknowledged records missing, "
            f"{verdict.unexpected:,} unexpected records in the stream.",
            "bold red",
        )


# -- wiring -------------------------------------------------------------------------------


def _botocore_client(target: Target) -> Any:
    import botocore.session

    session = botocore.session.get_session()
    return session.create_client(
        "kinesis",
        region_name=target.region,
        endpoint_url=target.endpoint_url,
        verify=target.verify,
        **target.credentials,
    )


def _ensure_stream(client: Any, stream: str, shards: int, say: _Printer) -> None:
    """Create ``stream`` with ``shards`` shards unless it exists; wait until it is ACTIVE."""
    try:
        summary = client.describe_stream_summary(StreamName=stream)["StreamDescriptionSummary"]
    except client.exceptions.ResourceNotFoundException:
        say(f"creating stream {stream} with {shards} shards")
        client.create_stream(StreamName=stream, ShardCount=shards)
    else:
        say(
            f"using the existing stream {stream} ({summary['OpenShardCount']} open shards, "
            f"{summary['StreamStatus']})"
        )
    client.get_waiter("stream_exists").wait(
        StreamName=stream, WaiterConfig={"Delay": 1, "MaxAttempts": 120}
    )


def _external_target(args: argparse.Namespace) -> Target:
    """The target for ``--endpoint``: credentials from botocore's chain, or the demo's."""
    import botocore.session

    session = botocore.session.get_session()
    region = args.region or session.get_config_variable("region") or "us-east-1"
    # no credentials anywhere: likely a local endpoint that accepts any
    credentials = {} if session.get_credentials() is not None else DEMO_CREDENTIALS
    endpoint = None if args.endpoint == "aws" else args.endpoint
    if args.ca_bundle is not None and not os.path.isfile(args.ca_bundle):
        raise SystemExit(f"anykpl demo: --ca-bundle {args.ca_bundle}: no such file")
    return Target(
        endpoint,
        region,
        credentials,
        args.stream,
        emulator=False,
        verify_certificate=args.verify,
        ca_bundle=args.ca_bundle,
    )


@contextmanager
def _started_target(args: argparse.Namespace, say: _Printer) -> Iterator[Target]:
    """The endpoint to use: ``--endpoint``, or the emulator started here (and stopped after)."""
    if args.endpoint is not None:
        import botocore.exceptions

        target = _external_target(args)
        where = target.endpoint_url or f"the Kinesis endpoint of {target.region}"
        if not target.verify_certificate:
            say(
                f"warning: TLS certificate verification is off (--no-verify): anyone between "
                f"here and {where} can read and change the traffic",
                "yellow",
            )
        client = _botocore_client(target)
        try:
            _ensure_stream(client, target.stream, args.shards, say)
        except botocore.exceptions.SSLError as exc:
            raise SystemExit(
                f"anykpl demo: TLS with {where} failed ({_tls_reason(exc)}); for a test "
                "endpoint with a self-signed certificate, give its CA with --ca-bundle, or "
                "--no-verify skips the check"
            ) from None
        except botocore.exceptions.EndpointConnectionError:
            raise SystemExit(f"anykpl demo: could not connect to {where}") from None
        finally:
            client.close()
        yield target
        return
    if not args.verify:
        raise SystemExit("anykpl demo: --no-verify applies to --endpoint only")
    if args.ca_bundle is not None:
        raise SystemExit("anykpl demo: --ca-bundle applies to --endpoint only")
    if importlib.util.find_spec("moto") is None:
        raise SystemExit(
            "anykpl demo starts the emulator, which needs moto: pip install 'anykpl[demo]' "
            "(or give --endpoint)"
        )
    from anykpl.emulator import spawn

    say(f"starting the emulator with stream {args.stream} ({args.shards} shards, limits on)")
    with spawn(streams={args.stream: args.shards}) as url:
        yield Target(url, args.region or "us-east-1", DEMO_CREDENTIALS, args.stream, True)


@contextmanager
def _unverified_quietly(verify: bool) -> Iterator[None]:
    """Without verification, silence urllib3's warning: the demo warned once, and urllib3
    would warn again on every request of its botocore clients."""
    with warnings.catch_warnings():
        if not verify:
            from urllib3.exceptions import InsecureRequestWarning

            warnings.simplefilter("ignore", InsecureRequestWarning)
        yield


def _tls_reason(exc: BaseException) -> str:
    """What went wrong in the handshake ("certificate verify failed: self-signed certificate"),
    from the ``ssl`` error botocore's ``SSLError`` wraps (in urllib3's), else its message."""
    import ssl

    seen: list[BaseException] = []
    pending: list[object] = [exc]
    while pending:
        current = pending.pop()
        if not isinstance(current, BaseException) or current in seen:
            continue
        seen.append(current)
        if isinstance(current, ssl.SSLCertVerificationError) and current.verify_message:
            return f"certificate verify failed: {current.verify_message}"
        if isinstance(current, ssl.SSLError) and current.reason:
            return str(current.reason)
        pending.extend([*current.args, *getattr(current, "kwargs", {}).values()])
        pending.extend([current.__cause__, current.__context__])
    return str(exc)


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed options; returns the exit status (0: nothing lost, 1: records
    missing or unexpected, 130: interrupted)."""
    console = _rich_console()
    say = _Printer(console)
    try:
        return _run(args, console, say)
    except KeyboardInterrupt:
        say()
        say("interrupted; nothing was checked", "yellow")
        return 130


def _run(args: argparse.Namespace, console: Any, say: _Printer) -> int:
    import anyio

    workload = workload_from(args)
    rng = random.Random(args.seed)
    with _unverified_quietly(args.verify), _started_target(args, say) as target:
        where = "the emulator" if target.emulator else (target.endpoint_url or "AWS")
        title = (
            f"anykpl demo · {args.backend} · stream {target.stream} on {where} · "
            f"{workload.devices:,} devices"
        )
        say(f"{workload.describe()}, on {args.backend}")
        emulator_stats = (
            _EmulatorStats(target.endpoint_url) if target.emulator and target.endpoint_url else None
        )
        with _progress_view(args.progress, console, title) as view:
            report = anyio.run(
                lambda: produce(target, workload, view, rng=rng, emulator_stats=emulator_stats),
                backend=args.backend,
            )
        final_stats = emulator_stats.fetch() if emulator_stats is not None else None
        _report_run(say, report, final_stats, target.stream)

        say()
        say(f"reading stream {target.stream} back from TRIM_HORIZON and deaggregating")
        prefix = run_prefix(workload.run_id)
        client = _botocore_client(target)
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
    _report_verdict(say, verdict, sum(found.values()), left_out)
    return verdict.exit_code
