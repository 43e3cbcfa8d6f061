"""Several producer processes sharing one stream: adaptive control's benchmark.

Starts the emulator with shard limits on (``anykpl.emulator.spawn``), creates a stream of
``--shards`` shards and runs ``--producers`` producer processes against it at once. Each one
alone could fill the stream: it submits ``--size``-byte records with random keys as fast as its
admission allows (``max_outstanding_records`` bounds its backlog). After ``--warmup`` seconds,
for ``--duration`` seconds, it measures:

- the aggregate the emulator accepted, as a share of the shards' capacity (per-second
  counters of the emulator, the binding limit of each shard);
- throttled Kinesis records as a share of those sent (accepted + throttled), and throttled
  bytes as a share of the bytes sent (records of different sizes weigh by what they cost);
- each producer's delivered bytes against its fair share (capacity ÷ producers).

Every producer checks every result; the run fails if any record failed. ::

    python benchmarks/shared_stream.py                      # 4 producers, 2 shards, adaptive
    python benchmarks/shared_stream.py --no-adaptive        # the KPL's static limiter
    python benchmarks/shared_stream.py --backend trio --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import deque
from typing import Any

CREDENTIALS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
REGION = "us-east-1"


async def producer_main(args: argparse.Namespace) -> dict[str, Any]:
    from anykpl import PendingRecord, Producer, ProducerConfig

    config = ProducerConfig(
        region=REGION,
        endpoint_url=args.endpoint,
        adaptive=args.adaptive,
        adaptive_increase=args.increase,
        adaptive_decrease=args.decrease,
        adaptive_window=args.window,
        max_outstanding_records=args.outstanding,
        record_ttl=120.0,
        **CREDENTIALS,
    )
    data = os.urandom(args.size)
    window_start = args.start + args.warmup
    window_end = window_start + args.duration
    delivered_bytes = delivered_records = failed = 0
    pending: deque[tuple[PendingRecord, float]] = deque()

    def settle(record: PendingRecord, submitted: float) -> None:
        # delivered when its last attempt ended: the attempts' delays and durations add up
        # to the time from admission to the end (records are settled in submission order, so
        # the time they are settled says nothing)
        nonlocal delivered_bytes, delivered_records, failed
        try:
            result = record.result()
        except Exception:
            failed += 1
            return
        end = submitted + sum(a.delay + a.duration for a in result.attempts)
        if window_start <= end < window_end:
            delivered_records += 1
            delivered_bytes += len(data)

    async with Producer(config) as producer:
        while time.time() < window_end:
            record = await producer.submit(args.stream, data)
            pending.append((record, time.time()))
            while pending and pending[0][0].done():
                settle(*pending.popleft())
        stats = producer.statistics().streams.get(args.stream)
        await producer.flush()
    for item in pending:
        settle(*item)
    shards = {}
    if stats is not None:
        shards = {
            shard: {"cuts": s.cuts, "throttled": s.throttled_records, "rate": s.rate[1]}
            for shard, s in stats.shards.items()
        }
    return {
        "delivered_records": delivered_records,
        "delivered_bytes": delivered_bytes,
        "failed": failed,
        "shards": shards,
    }


def run_child(args: argparse.Namespace) -> None:
    import anyio

    result = anyio.run(producer_main, args, backend=args.backend)
    print(json.dumps(result), flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import boto3

    from anykpl.emulator import EmulatorClient, spawn

    with spawn() as endpoint:
        client = EmulatorClient(endpoint)
        kinesis = boto3.client("kinesis", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS)
        stream = "shared"
        kinesis.create_stream(StreamName=stream, ShardCount=args.shards)
        start = time.time() + 3.0  # every producer has started and found the shard map by then
        argv = [
            sys.executable,
            __file__,
            "--child",
            "--endpoint",
            endpoint,
            "--stream",
            stream,
            "--start",
            repr(start),
            "--warmup",
            str(args.warmup),
            "--duration",
            str(args.duration),
            "--size",
            str(args.size),
            "--outstanding",
            str(args.outstanding),
            "--backend",
            args.backend,
            "--increase",
            str(args.increase),
            "--decrease",
            str(args.decrease),
            "--window",
            str(args.window),
        ]
        if not args.adaptive:
            argv.append("--no-adaptive")
        children = [
            subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(args.producers)
        ]
        outputs = [child.communicate()[0] for child in children]
        if any(child.returncode for child in children):
            raise SystemExit(f"a producer failed: {[c.returncode for c in children]}")
        results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
        before = time.time()
        stats = client.stats()
        # the emulator's per-second rows count whole seconds of its uptime
        origin = (before + time.time()) / 2 - stats["uptime"]
    first = int(start + args.warmup - origin) + 1  # whole seconds inside the window
    last = int(start + args.warmup + args.duration - origin) - 1
    seconds = last - first + 1
    accepted_records = throttled_records = accepted_bytes = throttled_bytes = 0
    used = capacity = 0.0
    per_shard = {}
    for shard in stats["shards"]:
        rows = [row for row in shard["per_second"] if first <= row[0] <= last]
        records = sum(row[1] for row in rows)
        nbytes = sum(row[2] for row in rows)
        throttled = sum(row[3] for row in rows)
        accepted_records += records
        throttled_records += throttled
        accepted_bytes += nbytes
        throttled_bytes += sum(row[4] for row in rows)
        # the binding limit: the larger share of the shard's records or bytes limit
        share = max(
            records / (shard["limit_records"] * seconds), nbytes / (shard["limit_bytes"] * seconds)
        )
        used += share
        capacity += 1
        per_shard[shard["shard_id"]] = {
            "utilisation": round(share, 4),
            "accepted_records": records,
            "throttled_records": throttled,
        }
    limit_bytes = stats["shards"][0]["limit_bytes"]
    fair_bytes = limit_bytes * args.shards * args.duration / args.producers
    report = {
        "producers": args.producers,
        "shards": args.shards,
        "adaptive": args.adaptive,
        "increase": args.increase,
        "decrease": args.decrease,
        "window": args.window,
        "backend": args.backend,
        "record_size": args.size,
        "window_seconds": seconds,
        "utilisation": round(used / capacity, 4),
        "throttled_share": round(
            throttled_records / max(1, accepted_records + throttled_records), 4
        ),
        "throttled_bytes_share": round(
            throttled_bytes / max(1, accepted_bytes + throttled_bytes), 4
        ),
        "per_shard": per_shard,
        "producer_share_of_fair": [round(r["delivered_bytes"] / fair_bytes, 3) for r in results],
        "failed": sum(r["failed"] for r in results),
        "cuts": [sum(s["cuts"] for s in r["shards"].values()) for r in results],
        "final_rates": [
            {shard: round(s["rate"] / limit_bytes, 3) for shard, s in r["shards"].items()}
            for r in results
        ],
    }
    return report


def main() -> None:
    from anykpl import ProducerConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--size", type=int, default=1024, help="bytes of data per record")
    parser.add_argument("--outstanding", type=int, default=5000)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--no-adaptive", dest="adaptive", action="store_false")
    defaults = ProducerConfig()
    parser.add_argument("--increase", type=float, default=defaults.adaptive_increase)
    parser.add_argument("--decrease", type=float, default=defaults.adaptive_decrease)
    parser.add_argument("--window", type=float, default=defaults.adaptive_window)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--stream", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    report = run(args)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
