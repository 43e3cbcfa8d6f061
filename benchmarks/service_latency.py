"""Service latency: handlers that each ``await producer.put_record(...)`` in a loop.

What an async service sees: ``--handlers`` tasks (50 and 500 by default), each putting a record
of ``--size`` bytes (500) under a key of its own and awaiting its result before the next, for
``--duration`` seconds (20), against a ``--shards``-shard stream (4) of the emulator with the
service's shard limits on (its own process), moto's server, or a URL. Every run is a fresh
producer in a fresh child process, with the defaults unless ``--set field=value`` says
otherwise (``--set record_max_buffered_time=0.005``, ``--set adaptive_batching=False``).

Reported per run: records/s (acknowledged records over the time from opening the producer to
its last result), latency of each ``put_record`` (p50, p90, p99, max), Kinesis records per user
record as read back from the stream, CPU seconds per
1,000 records (the producer's process, read-back excluded), and the round trip to the endpoint
(the median of 100 one-record PutRecords calls by botocore, before the producer opens). Every
acknowledged record is read back and deaggregated with AWS's ``aws_kinesis_agg``; a missing one
fails the run. ::

    python benchmarks/service_latency.py                          # 50 and 500 handlers, asyncio
    python benchmarks/service_latency.py --backend trio --handlers 50
    python benchmarks/service_latency.py --set adaptive_batching=False   # the KPL's batching
    python benchmarks/service_latency.py --endpoint moto --json latency.json
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import time
from array import array
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from endpoints import check_endpoint, overrides, start_moto_server

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


def round_trip(endpoint: str, stream: str, size: int) -> float:
    """The median of 100 one-record PutRecords calls (botocore), in seconds."""
    import boto3

    client = boto3.client("kinesis", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS)
    times = []
    for i in range(100):
        started = time.perf_counter()
        client.put_records(
            StreamName=stream, Records=[{"Data": b"r" * size, "PartitionKey": f"rtt-{i}"}]
        )
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def read_back(endpoint: str, stream: str) -> tuple[dict[tuple[str, bytes], int], int]:
    """Every user record in the stream (by AWS's deaggregator), counted, and the number of
    Kinesis records that held them."""
    import boto3
    from aws_kinesis_agg import deaggregator

    client = boto3.client("kinesis", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS)
    found: dict[tuple[str, bytes], int] = {}
    kinesis_records = 0
    shards = client.list_shards(StreamName=stream)["Shards"]
    for shard in shards:
        iterator = client.get_shard_iterator(
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while iterator:
            page = client.get_records(ShardIterator=iterator, Limit=10000)
            for record in page["Records"]:
                if record["PartitionKey"].startswith("rtt-"):
                    continue
                kinesis_records += 1
                users = list(deaggregator.iter_deaggregate_records([record], data_format="Boto3"))
                if not users[0]["kinesis"].get("aggregated"):
                    keys = [(record["PartitionKey"], bytes(record["Data"]))]
                else:
                    keys = [
                        (u["kinesis"]["partitionKey"], base64.b64decode(u["kinesis"]["data"]))
                        for u in users
                    ]
                for key in keys:
                    found[key] = found.get(key, 0) + 1
            if not page["Records"] and page.get("MillisBehindLatest", 0) == 0:
                break
            iterator = page.get("NextShardIterator")
    return found, kinesis_records


def record(opts: argparse.Namespace, packed: int) -> tuple[str, bytes]:
    """(partition key, data) of handler ``packed >> 32``'s record ``packed & 0xFFFFFFFF``."""
    index, n = packed >> 32, packed & 0xFFFFFFFF
    return f"h{index}-{n}", (f"{index}:{n}".encode()).ljust(opts.size, b".")


async def produce(opts: argparse.Namespace) -> dict[str, Any]:
    import anyio

    from anykpl import Producer

    settings = overrides(opts.set)
    latencies = array("d")
    # (handler, n) of each acknowledged record, packed: a list of tuples would be the
    # garbage collector's biggest load in this process, and its pauses would count as latency
    acknowledged = array("q")
    failures = 0
    cpu_started = time.process_time()
    opened = time.perf_counter()
    async with Producer(
        region=REGION, endpoint_url=opts.endpoint_url, **CREDENTIALS, **settings
    ) as producer:
        stop_at = time.perf_counter() + opts.duration

        async def handler(index: int) -> None:
            nonlocal failures
            n = 0
            prefix = f"{index}:".encode()
            while time.perf_counter() < stop_at:
                key = f"h{index}-{n}"
                data = (prefix + str(n).encode()).ljust(opts.size, b".")
                started = time.perf_counter()
                try:
                    await producer.put_record(opts.stream, data, key)
                except Exception:
                    failures += 1
                else:
                    latencies.append(time.perf_counter() - started)
                    acknowledged.append(index << 32 | n)
                n += 1

        async with anyio.create_task_group() as tg:
            for index in range(opts.handlers):
                tg.start_soon(handler, index)
        shards = producer.statistics().streams[opts.stream].shards.values()
        throttled = sum(shard.throttled_records for shard in shards)
        sent = sum(shard.records_sent for shard in shards)
    elapsed = time.perf_counter() - opened
    cpu = time.process_time() - cpu_started
    found, kinesis_records = read_back(opts.endpoint_url, opts.stream)
    missing = sum(1 for packed in acknowledged if record(opts, packed) not in found)
    ordered = sorted(latencies)
    return {
        "handlers": opts.handlers,
        "size": opts.size,
        "settings": opts.set,
        "backend": opts.backend,
        "acknowledged": len(acknowledged),
        "failures": failures,
        "missing": missing,
        "records_per_second": len(acknowledged) / elapsed,
        "elapsed": elapsed,
        "p50_ms": 1000 * quantile(ordered, 0.5) if ordered else None,
        "p90_ms": 1000 * quantile(ordered, 0.9) if ordered else None,
        "p99_ms": 1000 * quantile(ordered, 0.99) if ordered else None,
        "max_ms": 1000 * ordered[-1] if ordered else None,
        "kinesis_per_user": kinesis_records / max(1, len(acknowledged)),
        "kinesis_records_sent": sent,
        "throttled": throttled,
        "cpu_ms_per_1000": 1000 * cpu / max(1, len(acknowledged)) * 1000,
    }


def run_child(opts: argparse.Namespace) -> None:
    import anyio

    result = anyio.run(produce, opts, backend=opts.backend)
    print(json.dumps(result))


def run_one(args: argparse.Namespace, handlers: int) -> dict[str, Any]:
    import boto3

    stream = f"latency-{handlers}-{os.getpid()}-{time.monotonic_ns() % 100000}"

    def go(endpoint: str) -> dict[str, Any]:
        client = boto3.client("kinesis", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS)
        if args.endpoint != "emulator":
            client.create_stream(StreamName=stream, ShardCount=args.shards)
            client.get_waiter("stream_exists").wait(
                StreamName=stream, WaiterConfig={"Delay": 0.2, "MaxAttempts": 100}
            )
        rtt = round_trip(endpoint, stream, args.size)
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--endpoint-url",
            endpoint,
            "--stream",
            stream,
            "--handlers",
            str(handlers),
            "--size",
            str(args.size),
            "--duration",
            str(args.duration),
            "--backend",
            args.backend,
            *(f"--set={pair}" for pair in args.set),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"the producer's process failed:\n{done.stderr[-3000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        result["round_trip_ms"] = 1000 * rtt
        return result

    if args.endpoint == "emulator":
        from anykpl.emulator import spawn

        with spawn(streams={stream: args.shards}) as endpoint:  # the service's limits
            return go(endpoint)
    if args.endpoint == "moto":
        with start_moto_server() as endpoint:
            return go(endpoint)
    return go(args.endpoint)


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    settings = ", ".join(args.set) or "defaults"
    lines = [
        f"### {args.endpoint}, {args.backend}, {args.shards} shards, {args.size} B records, "
        f"{args.duration:g} s, {settings}",
        "",
        "| handlers | records/s | p50 ms | p90 ms | p99 ms | max ms | Kinesis records per "
        "user record | CPU ms per 1,000 | round trip ms | lost |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['handlers']} | {r['records_per_second']:,.0f} | {r['p50_ms']:.1f} | "
            f"{r['p90_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | "
            f"{r['kinesis_per_user']:.3f} | {r['cpu_ms_per_1000']:.0f} | "
            f"{r['round_trip_ms']:.1f} | {r['missing'] + r['failures']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handlers", type=int, nargs="+", default=[50, 500])
    parser.add_argument("--size", type=int, default=500)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument(
        "--endpoint",
        type=check_endpoint,
        default="emulator",
        help="'emulator' (anykpl's, with the service's shard limits; the default), 'moto' or a URL",
    )
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint-url", help=argparse.SUPPRESS)
    parser.add_argument("--stream", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.handlers = args.handlers[0]
        run_child(args)
        return
    results = []
    for handlers in args.handlers:
        result = run_one(args, handlers)
        results.append(result)
        print(
            f"{handlers} handlers: {result['records_per_second']:,.0f} records/s, "
            f"p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms",
            file=sys.stderr,
        )
        if result["missing"] or result["failures"]:
            print(
                f"LOST: {result['missing']} missing, {result['failures']} failed", file=sys.stderr
            )
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    if any(r["missing"] or r["failures"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
