"""Delivery under throttling: adaptive rate control against the static limiter, four scenarios.

Each scenario runs twice in one invocation, with the defaults (``adaptive=True``) and with
``adaptive=False`` (everything else at its default: ``record_ttl`` 30 s, the retry budget on,
``max_outstanding_records`` 100,000), each run on a fresh emulator (``anykpl.emulator.spawn``,
limits on, its own process) and in a fresh producer process, so memory and a stuck run cannot
leak from one run into the next:

- ``noise``: a 4-shard stream whose emulator throttles a quarter of the records whatever the rate
  (``Faults(record_throttle_rate=0.25)``); ``--records`` records of 100 B..2 KiB with random keys,
  submitted as fast as admission allows, then a flush. Throttles that are noise, not a full shard:
  adaptive control should not read them as congestion.
- ``storm``: a ``--storm-shards``-shard stream (1 unless told), ``--records`` records of 1 KiB
  with random keys, submitted as fast as admission allows; ``--storm-start`` seconds after the
  job's first submit (5 s by default: a producer that has held its rate for a while; 0.5 s: a
  storm in the producer's first second, as after a restart) the first shard's limits drop to
  0.3 for ``--storm-duration`` seconds (10), a throttle storm (``EmulatorClient.storm`` with that
  shard's id; with two or more shards the others stay unthrottled). Also measured: the seconds
  after the storm until the producer's rate for the storm's shard is back at 90 % of its ceiling
  (sampled from ``statistics()`` every 0.1 s while records wait; only while records wait, as the
  limiter applies a recovering rate when it drains), and that shard's use per second.
- ``overload``: a 2-shard stream offered 5× its capacity (10 MiB/s of 1 KiB records against 2 ×
  1 MiB/s) for ``--overload-duration`` seconds by a loop that submits on that schedule (and so
  waits when ``submit`` waits, then catches up), then a flush. Each record's data is its own
  ``bytes`` object, so the producer's peak RSS reflects a real workload.
- ``hotkey``: a 4-shard stream, four loops like overload's for ``--hotkey-duration`` seconds
  (30): the *hot* one offers 3,000 records/s of 1 KiB under one partition key (3× its shard's
  1 MiB/s), each of the three *cold* ones 250 records/s of 1 KiB under a key of its own that
  hashes to one of the other three shards (a quarter of the shard's capacity; the keys are chosen
  from the hash key ranges ListShards gives, by MD5 of the key as Kinesis routes it). Then a
  flush. One hot key should not slow the other shards' keys. Reported per class (hot, cold) and
  per cold shard: records due on the schedule, submitted, admitted within the duration and their
  share of what was due, ``submit`` waits (max, p99), delivery latency (p50, p99), delivered,
  expired, and the emulator's accepted and throttled Kinesis records of the class's shards.

Every record's result is checked and counted by the final attempt's error code (``Expired``
split by where it expired). Reported per run: wall time from the first submit to the last record
terminal, delivered / expired / failed records, Kinesis records throttled (the emulator's count,
and the injected ones apart), the producer's throttles and cuts, ``submit`` waits (max, p99),
delivery latency (p50, p99: from admission, the return of ``submit``, to the result, as the
record's attempts count it), peak RSS of the producer process. The tables (markdown) show both
modes and their ratio; ``--json`` writes every figure, and each run's timeline (each shard's
stored rate per second as the emulator counted it, its ceiling, the producer's backlog,
throttles and retries every 0.1 s, the storm or the hot key's start and end); ``--plot`` draws
each run's timeline into a picture next to the JSON (``<json>-<scenario>-<mode>.png``, or
``delivery-<scenario>-<mode>.png`` without ``--json``; matplotlib). ::

    python benchmarks/delivery.py                                  # all four, asyncio
    python benchmarks/delivery.py --scenario storm --backend trio
    python benchmarks/delivery.py --scenario storm --storm-shards 2 --storm-start 0.5
    python benchmarks/delivery.py --scenario overload --overload-duration 30 --json overload.json
    python benchmarks/delivery.py --scenario hotkey --adaptive-only --backend trio
    python benchmarks/delivery.py --scenario noise --static-only --records 5000
    python benchmarks/delivery.py --scenario storm --adaptive-only --json storm.json --plot
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from array import array
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

REGION = "us-east-1"
SCENARIOS = ("noise", "storm", "overload", "hotkey")
SHARDS = {"noise": 4, "storm": 1, "overload": 2, "hotkey": 4}  # storm: --storm-shards
NOISE_THROTTLE_RATE = 0.25
NOISE_SIZES = (100, 2048)
RECORD_SIZE = 1024
STORM_START = 5.0
STORM_DURATION = 10.0
STORM_FACTOR = 0.3
RECOVERED = 0.9  # share of the ceiling that counts as recovered
OVERLOAD = 5.0  # offered load, in multiples of the stream's byte capacity
HOT_RATE = 3000.0  # records/s of RECORD_SIZE under the hot key: 3× its shard's 1 MiB/s
COLD_RATE = 250.0  # records/s of RECORD_SIZE under each cold key: a quarter of its shard's
HOTKEY_DURATION = 30.0
HOT_KEY = "hot"
SAMPLE_INTERVAL = 0.1
RSS_INTERVAL = 0.5
#: seconds a run may take beyond its traffic before the producer process is told to stop
#: (it then closes, failing what is left within ``close_timeout``), and then killed
RUN_LIMIT = 180.0
KILL_GRACE = 90.0


# -- the producer process ---------------------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set size now (Linux), or its peak so far elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def quantile(values: array[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


class Outcomes:
    """Every record's result, counted by the final attempt's error code."""

    def __init__(self) -> None:
        self.delivered = 0
        self.failed: Counter[str] = Counter()
        self.expired_where: Counter[str] = Counter()
        self.latencies: array[float] = array("d")
        self.attempts = 0
        self.settled = 0

    def settle(self, pending: Any) -> None:
        from anykpl import errors

        self.settled += 1
        try:
            result = pending.result()
        except errors.RecordFailedError as failure:
            code = failure.error_code or "none"
            self.failed[code] += 1
            attempts = failure.result.attempts
            self.attempts += len(attempts)
            if code == errors.EXPIRED:
                # where it expired: waiting in the limiter, or after a failed attempt; and whether
                # Kinesis had ever seen it
                sent = sum(1 for a in attempts if a.duration > 0)
                sends = "never sent" if not sent else "sent once" if sent == 1 else "sent 2+"
                self.expired_where[f"{attempts[-1].error_message} ({sends})"] += 1
            return
        except RuntimeError:  # not terminal: cannot happen after the producer closed
            self.failed["not terminal"] += 1
            return
        self.delivered += 1
        self.attempts += len(result.attempts)
        self.latencies.append(sum(a.delay + a.duration for a in result.attempts))


class Flow:
    """One submitting loop: what it offered, its ``submit`` waits, and every record's result.

    ``key`` is its one partition key (``None``: a random key per record), ``shard_id`` the shard
    that key hashes to, ``rate`` the records per second its schedule offers (0: no schedule)."""

    def __init__(
        self, name: str, key: str | None = None, shard_id: str | None = None, rate: float = 0.0
    ) -> None:
        self.name = name
        self.key = key
        self.shard_id = shard_id
        self.rate = rate
        self.scheduled = 0  # records due on the schedule (or the records to submit)
        self.offered = 0  # submit called
        self.admitted_in_time = 0  # submit returned a handle before the traffic's end
        self.backpressure_timeouts = 0
        self.waits: array[float] = array("d")
        self.outcomes = Outcomes()
        self.window: deque[Any] = deque()  # handles not yet settled, in submit order

    def settle_done(self) -> None:
        while self.window and self.window[0].done():
            self.outcomes.settle(self.window.popleft())

    def settle_all(self) -> None:
        """After the producer closed: every record is terminal (what the close could not flush
        failed)."""
        while self.window:
            self.outcomes.settle(self.window.popleft())


def figures(flows: Iterable[Flow]) -> dict[str, Any]:
    """What some flows offered and what became of it, summed."""
    from anykpl import errors

    flows = list(flows)
    waits: array[float] = array("d")
    latencies: array[float] = array("d")
    failed: Counter[str] = Counter()
    expired_where: Counter[str] = Counter()
    for flow in flows:
        waits.extend(flow.waits)
        latencies.extend(flow.outcomes.latencies)
        failed.update(flow.outcomes.failed)
        expired_where.update(flow.outcomes.expired_where)
    timeouts = sum(flow.backpressure_timeouts for flow in flows)
    admitted = len(waits) - timeouts
    scheduled = sum(flow.scheduled for flow in flows)
    admitted_in_time = sum(flow.admitted_in_time for flow in flows)
    settled = sum(flow.outcomes.settled for flow in flows)
    expired = failed.get(errors.EXPIRED, 0)
    return {
        "keys": [flow.key for flow in flows if flow.key is not None],
        "shard_ids": sorted({flow.shard_id for flow in flows if flow.shard_id is not None}),
        "rate": sum(flow.rate for flow in flows),
        "scheduled": scheduled,
        "offered": sum(flow.offered for flow in flows),
        "admitted": admitted,
        "admitted_in_time": admitted_in_time,
        "admitted_share": round(admitted_in_time / scheduled, 4) if scheduled else None,
        "backpressure_timeouts": timeouts,
        "settled": settled,
        "delivered": sum(flow.outcomes.delivered for flow in flows),
        "failed_by_code": dict(failed.most_common()),
        "failed_other": sum(n for code, n in failed.items() if code != errors.EXPIRED),
        "expired": expired,
        "expired_share": round(expired / max(1, admitted), 4),
        "expired_where": dict(expired_where.most_common()),
        "submit_wait_total": round(sum(waits), 3),
        "submit_wait_max": round(max(waits, default=0.0), 4),
        "submit_wait_p99": round(quantile(waits, 0.99) or 0.0, 4),
        "latency_p50": round(quantile(latencies, 0.5) or 0.0, 3),
        "latency_p99": round(quantile(latencies, 0.99) or 0.0, 3),
        "latency_max": round(max(latencies, default=0.0), 3),
        "attempts_per_record": round(
            sum(flow.outcomes.attempts for flow in flows) / max(1, settled), 3
        ),
    }


async def produce(opts: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import anyio.to_thread

    import anykpl
    from anykpl import Producer, ProducerConfig, errors
    from anykpl.emulator import EmulatorClient

    config = ProducerConfig(
        region=REGION,
        endpoint_url=opts.endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
        adaptive=opts.adaptive,
    )
    stream, scenario = opts.stream, opts.scenario
    rng = random.Random(opts.seed)
    source = os.urandom(8 * 1024 * 1024)
    view = memoryview(source)

    def make(size: int) -> tuple[bytes, str]:
        start = rng.randrange(len(source) - size)
        return bytes(view[start : start + size]), f"{rng.getrandbits(64):016x}"

    if scenario == "hotkey":
        flows = [Flow(**flow) for flow in json.loads(opts.flows)]
    else:
        flows = [Flow(scenario)]
    # the shard whose rate is sampled: the storm's, or (None) the lowest of all
    watched = opts.storm_shard if scenario == "storm" else None
    samples: list[tuple[float, float]] = []  # (seconds since t0, rate share of ceiling)
    # the producer's figures for the timeline: seconds since t0, outstanding, throttled, retried
    backlog: dict[str, list[float]] = {"t": [], "outstanding": [], "throttled": [], "retried": []}
    peak = {"rss": rss_bytes(), "outstanding": 0}
    t0 = math.inf

    async def sample(producer: Producer) -> None:
        tick = 0
        while True:
            statistics = producer.statistics()
            peak["outstanding"] = max(peak["outstanding"], statistics.outstanding_records)
            shards = statistics.streams[stream].shards if stream in statistics.streams else {}
            if t0 < math.inf:
                backlog["t"].append(round(time.perf_counter() - t0, 3))
                backlog["outstanding"].append(statistics.outstanding_records)
                backlog["throttled"].append(statistics.errors_by_code.get(errors.THROTTLED, 0))
                backlog["retried"].append(
                    statistics.metrics.get(anykpl.MetricKey("RetriesPerRecord"), 0)
                )
            if shards and t0 < math.inf:
                if watched in shards:
                    share = shards[watched].rate[1] / shards[watched].ceiling[1]
                else:
                    share = min(s.rate[1] / s.ceiling[1] for s in shards.values())
                samples.append((time.perf_counter() - t0, share))
            if tick % round(RSS_INTERVAL / SAMPLE_INTERVAL) == 0:
                peak["rss"] = max(peak["rss"], rss_bytes())
            tick += 1
            await anyio.sleep(SAMPLE_INTERVAL)

    async def submit(producer: Producer, flow: Flow, size: int, end: float = math.inf) -> None:
        data, key = make(size)
        flow.offered += 1
        started = time.perf_counter()
        try:
            pending = await producer.submit(stream, data, partition_key=flow.key or key)
        except errors.BackpressureTimeout:
            flow.backpressure_timeouts += 1
            return
        finally:
            admitted_at = time.perf_counter()
            flow.waits.append(admitted_at - started)
        if admitted_at < end:
            flow.admitted_in_time += 1
        flow.window.append(pending)
        flow.settle_done()

    async def on_schedule(producer: Producer, flow: Flow, rate: float, duration: float) -> None:
        """Submit ``rate`` records/s of RECORD_SIZE for ``duration`` s from t0: a submit that
        waits puts the loop behind, and it then catches up; what is still due at the end is
        not submitted."""
        end = t0 + duration
        flow.scheduled = total = int(duration * rate)
        while (now := time.perf_counter()) < end:
            due = min(int((now - t0) * rate) + 1, total)
            if flow.offered >= due:
                await anyio.sleep(0.002)
                continue
            while flow.offered < due and time.perf_counter() < end:
                await submit(producer, flow, RECORD_SIZE, end)

    timed_out = False
    submitted_at = flushed_at = math.nan
    traffic = {"overload": opts.overload_duration, "hotkey": opts.hotkey_duration}.get(scenario, 0)
    async with Producer(config) as producer, anyio.create_task_group() as tasks:
        # the shard map and the connections ready before the clock starts
        await producer.put_record(stream, b"warm-up", partition_key="warm-up")
        tasks.start_soon(sample, producer)
        if scenario == "storm":
            client = EmulatorClient(opts.endpoint)
            await anyio.to_thread.run_sync(
                lambda: client.storm(
                    stream,
                    duration=opts.storm_duration,
                    factor=STORM_FACTOR,
                    shard_id=opts.storm_shard,
                    start=opts.storm_start,
                )
            )
        t0 = time.perf_counter()
        t0_wall = time.time()
        with anyio.move_on_after(traffic + RUN_LIMIT) as scope:
            if scenario in ("noise", "storm"):
                flows[0].scheduled = opts.records
                for _ in range(opts.records):
                    size = rng.randint(*NOISE_SIZES) if scenario == "noise" else RECORD_SIZE
                    await submit(producer, flows[0], size)
            elif scenario == "overload":
                # OVERLOAD × the stream's bytes per second in RECORD_SIZE records
                rate = OVERLOAD * SHARDS["overload"] * 1024 * 1024 / RECORD_SIZE
                await on_schedule(producer, flows[0], rate, opts.overload_duration)
            else:
                async with anyio.create_task_group() as loops:
                    for flow in flows:
                        loops.start_soon(on_schedule, producer, flow, flow.rate, traffic)
            submitted_at = time.perf_counter() - t0
            await producer.flush()
            flushed_at = time.perf_counter() - t0
        timed_out = scope.cancelled_caught
        peak["rss"] = max(peak["rss"], rss_bytes())
        final = producer.statistics()
        tasks.cancel_scope.cancel()
    closed_at = time.perf_counter() - t0
    for flow in flows:
        flow.settle_all()
    shards = final.streams[stream].shards if stream in final.streams else {}
    overall = figures(flows)
    wall = closed_at if timed_out else flushed_at
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    result = {
        "anykpl": os.path.dirname(anykpl.__file__),
        "scenario": scenario,
        "adaptive": opts.adaptive,
        "backend": opts.backend,
        "record_ttl": config.record_ttl,
        "retry_budget": config.retry_budget,
        "t0_wall": t0_wall,
        "timed_out": timed_out,
        **{key: value for key, value in overall.items() if key not in ("keys", "shard_ids")},
        "submit_seconds": None if math.isnan(submitted_at) else round(submitted_at, 3),
        # timed out: until the close had failed what was left
        "wall_seconds": round(wall, 3),
        "delivered_per_second": round(overall["delivered"] / wall, 1),
        "producer_throttled_records": sum(s.throttled_records for s in shards.values()),
        "cuts": sum(s.cuts for s in shards.values()),
        "records_sent": sum(s.records_sent for s in shards.values()),
        "errors_by_code": dict(final.errors_by_code),
        "retry_budget_exhausted": final.streams[stream].retry_budget_exhausted
        if stream in final.streams
        else 0,
        "peak_outstanding": peak["outstanding"],
        "peak_rss_mib": round(peak["rss"] / 2**20, 1),
        "maxrss_mib": round(usage.ru_maxrss / 1024, 1),
        "cpu_seconds": round(usage.ru_utime + usage.ru_stime, 2),
        "rate_samples": [(round(t, 2), round(share, 4)) for t, share in samples],
        "producer_timeline": backlog,
    }
    if scenario == "storm":
        # scheduled just before t0, to start storm_start later
        result.update(
            storm_scheduled=0.0,
            storm_start=opts.storm_start,
            storm_duration=opts.storm_duration,
            storm_factor=STORM_FACTOR,
            storm_shard=opts.storm_shard,
        )
    if scenario == "hotkey":
        result["hotkey_duration"] = opts.hotkey_duration
        result["classes"] = {
            "hot": figures(flow for flow in flows if flow.name == "hot"),
            "cold": figures(flow for flow in flows if flow.name == "cold"),
            **{f"cold {flow.shard_id}": figures([flow]) for flow in flows if flow.name == "cold"},
        }
    return result


def run_child(opts: argparse.Namespace) -> None:
    import logging

    import anyio

    # the producer logs each batch of expired records; the tables count them
    logging.getLogger("anykpl").setLevel(logging.ERROR)
    result = anyio.run(produce, opts, backend=opts.backend)
    print(json.dumps(result), flush=True)


# -- the orchestrating process ----------------------------------------------------------------


def shard_count(scenario: str, args: argparse.Namespace) -> int:
    return args.storm_shards if scenario == "storm" else SHARDS[scenario]


def hash_key_ranges(endpoint: str, stream: str) -> list[tuple[str, int, int]]:
    """The stream's shards as (shard id, first hash key, last hash key), from ListShards
    (boto3, which the emulator's moto brings), in shard id order."""
    import boto3

    kinesis = boto3.client(
        "kinesis",
        region_name=REGION,
        endpoint_url=endpoint,
        aws_access_key_id="bench",
        aws_secret_access_key="bench",
    )
    try:
        shards = kinesis.list_shards(StreamName=stream)["Shards"]
    finally:
        kinesis.close()
    return sorted(
        (
            shard["ShardId"],
            int(shard["HashKeyRange"]["StartingHashKey"]),
            int(shard["HashKeyRange"]["EndingHashKey"]),
        )
        for shard in shards
    )


def shard_of(key: str, ranges: list[tuple[str, int, int]]) -> str:
    """The shard Kinesis routes ``key`` to: the one whose hash key range holds the MD5 of the
    key's UTF-8 bytes, read as a big-endian 128-bit integer."""
    hash_key = int.from_bytes(hashlib.md5(key.encode(), usedforsecurity=False).digest(), "big")
    return next(shard for shard, low, high in ranges if low <= hash_key <= high)


def hotkey_flows(ranges: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    """The hot key on its shard, and for each other shard the first key ``cold-N`` that
    hashes to it."""
    hot_shard = shard_of(HOT_KEY, ranges)
    cold: dict[str, str] = {}
    n = 0
    while len(cold) < len(ranges) - 1:
        key = f"cold-{n}"
        n += 1
        shard = shard_of(key, ranges)
        if shard != hot_shard:
            cold.setdefault(shard, key)
    return [{"name": "hot", "key": HOT_KEY, "shard_id": hot_shard, "rate": HOT_RATE}] + [
        {"name": "cold", "key": cold[shard], "shard_id": shard, "rate": COLD_RATE}
        for shard in sorted(cold)
    ]


def storm_recovery(result: dict[str, Any]) -> dict[str, Any]:
    """From the rate samples of the storm's shard: its rate when the storm ended, and the
    seconds after it ended until the rate was back at ``RECOVERED`` of the ceiling (``None``
    without adaptive control, which never cuts, or if it had not recovered by the last
    sample)."""
    samples = result.pop("rate_samples")
    storm_end = result["storm_scheduled"] + result["storm_start"] + result["storm_duration"]
    at_end = next((share for t, share in samples if t >= storm_end), None)
    recovery = None
    if result["adaptive"]:
        recovery = next(
            (
                round(max(0.0, t - storm_end), 2)
                for t, share in samples
                if t >= storm_end and share >= RECOVERED
            ),
            None,
        )
    last = samples[-1][0] if samples else None
    per_second: dict[int, float] = {}
    for t, share in samples:
        per_second.setdefault(int(t), share)
    return {
        "rate_at_storm_end": at_end,
        "recovery_seconds": recovery,
        "last_sample_after_storm_end": None if last is None else round(last - storm_end, 2),
        "rate_per_second": [per_second[s] for s in sorted(per_second)],
    }


def emulator_figures(
    stats: dict[str, Any], stream: str, t0_wall: float, origin: float
) -> dict[str, Any]:
    """The emulator's counters for ``stream``, and its use per second of the run (the busier
    of records and bytes, as a share of the unstormed limits of all its shards), also shard by
    shard."""
    from anykpl.emulator import Limits

    shards = [s for s in stats["shards"] if s["stream"] == stream]
    limits = Limits()
    use: dict[int, float] = {}
    throttled_per_second: dict[int, int] = {}
    by_shard: dict[str, dict[str, Any]] = {}
    for shard in shards:
        shard_use = []
        for second, records, nbytes, throttled, _tb in shard["per_second"]:
            # the emulator's second `second` began at origin + second; seconds since t0
            offset = round(origin + second - t0_wall)
            share = max(records / limits.records_per_second, nbytes / limits.bytes_per_second)
            use[offset] = use.get(offset, 0.0) + share / len(shards)
            throttled_per_second[offset] = throttled_per_second.get(offset, 0) + throttled
            if offset >= 0:
                shard_use.append([offset, round(share, 3), throttled])
        by_shard[shard["shard_id"]] = {
            "emulator_accepted_records": shard["accepted_records"],
            "emulator_throttled_records": shard["throttled_records"],
            "use_per_second": shard_use,
        }
    accepted = sum(s["accepted_records"] for s in shards)
    throttled = sum(s["throttled_records"] for s in shards)
    return {
        "emulator_accepted_records": accepted,
        "emulator_throttled_records": throttled,
        "throttled_share": round(throttled / max(1, accepted + throttled), 4),
        "emulator_injected_throttles": sum(s.get("injected_throttled_records", 0) for s in shards),
        "emulator_failed_records": sum(s["failed_records"] for s in shards),
        "use_per_second": [
            [s, round(use[s], 3), throttled_per_second[s]] for s in sorted(use) if s >= 0
        ],
        "by_shard": by_shard,
    }


def timeline(
    result: dict[str, Any], stats: dict[str, Any], stream: str, origin: float
) -> dict[str, Any]:
    """The run's timeline, in the shape ``anykpl demo --plot`` draws
    (``anykpl._commands.demo._timeline``): each shard's stored records, bytes and throttles per
    second since t0 (the emulator's counts), its byte ceiling as it changed, the producer's
    figures, and the storm's or the load's start and end."""
    from anykpl.emulator import Limits

    limits = Limits()
    scenario = result["scenario"]
    end = result["wall_seconds"]
    shards: dict[str, dict[str, list[float]]] = {}
    ceilings: dict[str, list[list[Any]]] = {}
    for shard in stats["shards"]:
        if shard["stream"] != stream:
            continue
        series: dict[str, list[float]] = {"t": [], "records": [], "bytes": [], "throttled": []}
        for second, records, nbytes, throttled, _tb in shard["per_second"]:
            at = round(origin + second - result["t0_wall"], 3)
            if -1.0 <= at <= end + 1.0:
                series["t"].append(at)
                series["records"].append(records)
                series["bytes"].append(nbytes)
                series["throttled"].append(throttled)
        shards[shard["shard_id"]] = series
        full = [limits.records_per_second, limits.bytes_per_second]
        points = [[0.0, *full]]
        if scenario == "storm" and shard["shard_id"] == result["storm_shard"]:
            start = result["storm_start"]
            cut = [value * result["storm_factor"] for value in full]
            points += [[start, *cut], [start + result["storm_duration"], *full]]
        ceilings[shard["shard_id"]] = [*points, [end, *points[-1][1:]]]
    events: list[list[Any]] = []
    if scenario == "storm":
        start, duration = result["storm_start"], result["storm_duration"]
        events = [
            [start, f"storm: {result['storm_shard']} cut to {result['storm_factor']:.0%}"],
            [start + duration, "storm over"],
        ]
    elif scenario in ("overload", "hotkey"):
        duration = result["hotkey_duration"] if scenario == "hotkey" else None
        duration = duration or result.get("submit_seconds") or end
        what = "the hot key at 3× its shard" if scenario == "hotkey" else "5× the stream"
        events = [[0.0, f"{scenario}: {what} offered"], [duration, f"{scenario}: offer stops"]]
    return {
        "shards": shards,
        "limits": ceilings,
        "producer": result.pop("producer_timeline"),
        "events": events,
    }


def plot_path(args: argparse.Namespace, scenario: str, mode: str) -> str:
    """Where ``--plot`` draws a run: next to the ``--json`` file, or here."""
    stem = os.path.splitext(args.json)[0] if args.json else "delivery"
    return f"{stem}-{scenario}-{mode}.png"


def run_one(scenario: str, adaptive: bool, args: argparse.Namespace) -> dict[str, Any]:
    from anykpl.emulator import EmulatorClient, Faults, spawn

    faults = Faults(record_throttle_rate=NOISE_THROTTLE_RATE) if scenario == "noise" else None
    stream = f"delivery-{scenario}"
    traffic = {"overload": args.overload_duration, "hotkey": args.hotkey_duration}.get(scenario, 0)
    with spawn(faults=faults) as endpoint:
        client = EmulatorClient(endpoint)
        client.create_stream(stream, shard_count(scenario, args))
        ranges = hash_key_ranges(endpoint, stream)
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--endpoint",
            endpoint,
            "--stream",
            stream,
            "--scenario",
            scenario,
            "--backend",
            args.backend,
            "--records",
            str(args.records),
            "--overload-duration",
            repr(args.overload_duration),
            "--hotkey-duration",
            repr(args.hotkey_duration),
            "--storm-start",
            repr(args.storm_start),
            "--storm-duration",
            repr(args.storm_duration),
            # the storm's shard: the first (with one shard, the stream's only one)
            "--storm-shard",
            ranges[0][0],
            "--flows",
            json.dumps(hotkey_flows(ranges) if scenario == "hotkey" else []),
            "--seed",
            str(args.seed),
        ]
        if not adaptive:
            argv.append("--static-only")
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            output, _ = child.communicate(timeout=traffic + RUN_LIMIT + KILL_GRACE)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            return {
                "scenario": scenario,
                "adaptive": adaptive,
                "error": "killed: no result in time",
            }
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        if child.returncode:
            return {"scenario": scenario, "adaptive": adaptive, "error": f"exit {child.returncode}"}
        result: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
        before = time.time()
        stats = client.stats()
        origin = (before + time.time()) / 2 - stats["uptime"]
    result["shards"] = len(ranges)
    result.update(emulator_figures(stats, stream, result["t0_wall"], origin))
    shares = [share for _, share in result["rate_samples"]]
    result["rate_lowest"] = min(shares, default=None)
    result["rate_mean"] = round(sum(shares) / len(shares), 4) if shares else None
    result["timeline"] = timeline(result, stats, stream, origin)
    if scenario == "storm":
        result.update(storm_recovery(result))
    else:
        result.pop("rate_samples")
    for figures_ in result.get("classes", {}).values():
        # the emulator's counts for the shards of a class
        for key in ("emulator_accepted_records", "emulator_throttled_records"):
            figures_[key] = sum(result["by_shard"][s][key] for s in figures_["shard_ids"])
    return result


ROWS: dict[str, list[tuple[str, str]]] = {
    "common": [
        ("wall_seconds", "wall s (first submit → last terminal)"),
        ("submit_seconds", "submit loop s"),
        ("scheduled", "records due (overload, hotkey: on the schedule)"),
        ("offered", "records offered (submit called)"),
        ("admitted", "records admitted"),
        ("delivered", "delivered"),
        ("expired", "expired"),
        ("expired_share", "expired / admitted"),
        ("failed_other", "failed, other codes"),
        ("delivered_per_second", "delivered / s"),
        ("emulator_accepted_records", "Kinesis records accepted (emulator)"),
        ("emulator_throttled_records", "Kinesis records throttled (emulator)"),
        ("throttled_share", "throttled / (accepted + throttled)"),
        ("emulator_injected_throttles", "… of which injected"),
        ("producer_throttled_records", "throttled (producer's count)"),
        ("cuts", "rate cuts"),
        ("retry_budget_exhausted", "retry budget exhausted"),
        ("attempts_per_record", "attempts per record"),
        ("submit_wait_total", "submit wait total s"),
        ("submit_wait_max", "submit wait max s"),
        ("submit_wait_p99", "submit wait p99 s"),
        ("backpressure_timeouts", "BackpressureTimeout"),
        ("latency_p50", "delivery latency p50 s"),
        ("latency_p99", "delivery latency p99 s"),
        ("rate_lowest", "lowest rate / ceiling (sampled every 0.1 s)"),
        ("rate_mean", "mean rate / ceiling"),
        ("peak_outstanding", "peak outstanding records"),
        ("peak_rss_mib", "peak RSS MiB"),
        ("cpu_seconds", "producer process CPU s"),
    ],
    "storm": [
        ("rate_at_storm_end", "storm shard's rate / ceiling at storm end"),
        ("recovery_seconds", "s after storm to ≥ 90 % of ceiling"),
        ("last_sample_after_storm_end", "last rate sample, s after storm"),
    ],
    # per class of the hotkey scenario
    "hotkey": [
        ("keys", "partition key(s)"),
        ("shard_ids", "shard(s)"),
        ("rate", "records/s offered"),
        ("scheduled", "records due on the schedule"),
        ("offered", "records submitted (submit called)"),
        ("admitted_in_time", "admitted within the duration"),
        ("admitted_share", "share of the offer admitted"),
        ("submit_wait_max", "submit wait max s"),
        ("submit_wait_p99", "submit wait p99 s"),
        ("backpressure_timeouts", "BackpressureTimeout"),
        ("latency_p50", "delivery latency p50 s"),
        ("latency_p99", "delivery latency p99 s"),
        ("admitted", "admitted (in all)"),
        ("delivered", "delivered"),
        ("expired", "expired"),
        ("expired_share", "expired / admitted"),
        ("failed_other", "failed, other codes"),
        ("emulator_accepted_records", "Kinesis records accepted (emulator, the class's shards)"),
        ("emulator_throttled_records", "Kinesis records throttled (emulator, the class's shards)"),
    ],
}


def cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1 else f"{value:,.2f}"
    if isinstance(value, list):
        return ", ".join(cell(v) for v in value)
    return str(value)


def title(scenario: str, runs: dict[str, dict[str, Any]], backend: str) -> str:
    run = next((run for run in runs.values() if "error" not in run), {})
    shards = run.get("shards", SHARDS[scenario])
    text = f"### {scenario} ({backend}, {shards} shard(s)"
    if scenario == "storm" and run:
        text += (
            f"; {run['storm_shard']} at {run['storm_factor']:g} of its limits from "
            f"{run['storm_start']:g} s for {run['storm_duration']:g} s"
        )
    if scenario == "hotkey" and run:
        text += f"; {run['hotkey_duration']:g} s"
    return text + ")"


def class_table(run: dict[str, Any], mode: str) -> list[str]:
    """The hotkey scenario's figures per class (hot, cold) and per cold shard."""
    classes = run["classes"]
    lines = [
        f"#### by class, {mode}",
        "",
        "| metric | " + " | ".join(classes) + " |",
        "|---" * (len(classes) + 1) + "|",
    ]
    for key, label in ROWS["hotkey"]:
        values = [figures_.get(key) for figures_ in classes.values()]
        lines.append(f"| {label} | " + " | ".join(cell(v) for v in values) + " |")
    return [*lines, ""]


def table(scenario: str, runs: dict[str, dict[str, Any]], backend: str) -> str:
    modes = [mode for mode in ("adaptive", "static") if mode in runs]
    lines = [title(scenario, runs, backend), ""]
    for mode in modes:
        if "error" in runs[mode]:
            lines.append(f"- {mode}: {runs[mode]['error']}")
    modes = [mode for mode in modes if "error" not in runs[mode]]
    if not modes:
        return "\n".join(lines)
    header = (
        "| metric | " + " | ".join(modes) + (" | adaptive / static |" if len(modes) == 2 else " |")
    )
    lines += [header, "|---" * (len(modes) + 1 + (len(modes) == 2)) + "|"]
    rows = ROWS["common"] + (ROWS["storm"] if scenario == "storm" else [])
    for key, label in rows:
        values = [runs[mode].get(key) for mode in modes]
        line = f"| {label} | " + " | ".join(cell(v) for v in values) + " |"
        if len(modes) == 2:
            a, s = values
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            ratio = f"{a / s:.2f}" if numbers and s else "–"
            line += f" {ratio} |"
        lines.append(line)
    lines.append("")
    if scenario == "hotkey":
        for mode in modes:
            lines += class_table(runs[mode], mode)
    for mode in modes:
        run = runs[mode]
        details = [f"failed by code {run['failed_by_code'] or {}}"]
        if run["expired_where"]:
            details.append(f"expired where {run['expired_where']}")
        if run["timed_out"]:
            details.append("TIMED OUT (the close failed what was left)")
        lines.append(f"- {mode}: " + "; ".join(details))
        if scenario == "storm":
            stormed = run["by_shard"].get(run["storm_shard"], {}).get("use_per_second", [])
            use = " ".join(f"{u:.2f}" for _, u, _ in stormed)
            rate = " ".join(f"{r:.2f}" for r in run["rate_per_second"])
            lines.append(
                f"  - {run['storm_shard']} use per second (of 1 MiB/s or 1000 rec/s): {use}"
            )
            lines.append(f"  - its producer rate / ceiling per second: {rate}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--records", type=int, default=20_000, help="records of noise and storm")
    parser.add_argument(
        "--overload-duration", type=float, default=60.0, help="seconds of overload (60)"
    )
    parser.add_argument(
        "--hotkey-duration",
        type=float,
        default=HOTKEY_DURATION,
        help=f"seconds of the hotkey scenario's traffic ({HOTKEY_DURATION:g})",
    )
    parser.add_argument(
        "--storm-start",
        type=float,
        default=STORM_START,
        help=f"seconds from the first submit to the storm ({STORM_START:g}; 0.5: a young producer)",
    )
    parser.add_argument(
        "--storm-duration",
        type=float,
        default=STORM_DURATION,
        help=f"seconds the storm lasts ({STORM_DURATION:g})",
    )
    parser.add_argument(
        "--storm-shards",
        type=int,
        default=SHARDS["storm"],
        help="shards of the storm scenario's stream; the storm hits the first only (1)",
    )
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--adaptive-only", action="store_true", help="only adaptive=True")
    modes.add_argument("--static-only", action="store_true", help="only adaptive=False")
    parser.add_argument("--seed", type=int, default=1, help="seed of sizes, keys and payloads")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--plot",
        action="store_true",
        help="draw each run's timeline next to the --json file (or here): "
        "<json>-<scenario>-<mode>.png (matplotlib)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--stream", help=argparse.SUPPRESS)
    parser.add_argument("--storm-shard", help=argparse.SUPPRESS)
    parser.add_argument("--flows", default="[]", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.storm_shards < 1:
        parser.error("--storm-shards must be at least 1")
    if args.storm_start < 0 or args.storm_duration <= 0 or args.hotkey_duration <= 0:
        parser.error("--storm-start must be >= 0, --storm-duration and --hotkey-duration > 0")
    if args.plot and not args.child:
        from anykpl._commands.demo._timeline import matplotlib_missing

        if (why := matplotlib_missing()) is not None:
            parser.error(why)
    if args.child:
        args.adaptive = not args.static_only
        run_child(args)
        return
    import anykpl

    print(f"anykpl from {os.path.dirname(anykpl.__file__)}, backend {args.backend}", flush=True)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    modes_run = ["static"] if args.static_only else ["adaptive"]
    if not (args.static_only or args.adaptive_only):
        modes_run.append("static")
    report: dict[str, Any] = {
        "backend": args.backend,
        "records": args.records,
        "overload_duration": args.overload_duration,
        "hotkey_duration": args.hotkey_duration,
        "storm_start": args.storm_start,
        "storm_duration": args.storm_duration,
        "storm_shards": args.storm_shards,
        "anykpl": os.path.dirname(anykpl.__file__),
        "runs": {},
    }
    for scenario in scenarios:
        runs = {}
        for mode in modes_run:
            started = time.perf_counter()
            print(f"{scenario} {mode} ...", end=" ", flush=True)
            runs[mode] = run_one(scenario, mode == "adaptive", args)
            print(f"{time.perf_counter() - started:.0f} s", flush=True)
        report["runs"][scenario] = runs
        print()
        print(table(scenario, runs, args.backend), flush=True)
        print()
        if args.json:  # after each scenario, so a later failure keeps the earlier results
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2)
        if args.plot:
            draw(args, scenario, runs)


def draw(args: argparse.Namespace, scenario: str, runs: dict[str, dict[str, Any]]) -> None:
    """``--plot``: each run's timeline, next to the JSON (which is written first)."""
    from anykpl._commands.demo._timeline import plot

    for mode, run in runs.items():
        if "timeline" not in run:
            continue
        path = plot_path(args, scenario, mode)
        try:
            plot(
                run["timeline"],
                path,
                f"benchmarks/delivery.py · {scenario} · {mode} · {args.backend}",
            )
        except OSError as exc:
            print(f"  could not draw {path}: {exc}", flush=True)
        else:
            print(f"  drawn in {path}", flush=True)


if __name__ == "__main__":
    main()
