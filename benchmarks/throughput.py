"""End-to-end producer throughput: 100-byte records, aggregation on, limits off.

The endpoint (the emulator, ``anykpl.emulator.spawn``, limits off; or ``--endpoint moto``, moto's
own server, or a URL) runs in its own process;
this process is the one producer. For each backend it submits ``--records`` records
with ``--keys`` distinct partition keys as fast as admission allows, flushes, checks every
result, and reports user records/s (wall clock, submit to last result) and CPU seconds per
100k records of this process.

    python benchmarks/throughput.py --records 300000
    python benchmarks/throughput.py --backend trio --profile   # pyinstrument of the hot path
    python benchmarks/throughput.py --batch 500                # submit_many, 500 at a time
    python benchmarks/throughput.py --await-each               # submit each, then await each
    python benchmarks/throughput.py --endpoint moto            # against moto's own server
    python benchmarks/throughput.py --spool off                # with a spool (spool_fsync=off)
    python benchmarks/throughput.py --spool none,off,interval,commit   # each, interleaved
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections import deque
from typing import Any

import anyio
import boto3

from anykpl import PendingBatch, PendingRecord, Producer, ProducerConfig
from anykpl.errors import RecordFailedError
from endpoints import ENDPOINT_HELP, check_endpoint, start_endpoint

CREDENTIALS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
#: where the spool's directories go (a real disk, not a tmpfs: BENCH_SPOOL_PARENT overrides)
SPOOL_PARENT = os.environ.get("BENCH_SPOOL_PARENT", os.path.dirname(os.path.abspath(__file__)))


async def run_once(
    endpoint: str,
    stream: str,
    records: int,
    keys: int,
    retain: bool,
    adaptive: bool = True,
    batch: int = 0,
    spool: str = "none",
    adaptive_batching: bool = True,
    await_each: bool = False,
) -> dict[str, Any]:
    spool_options: dict[str, Any] = {}
    scratch = None
    if spool != "none":
        scratch = tempfile.TemporaryDirectory(prefix="anykpl-spool-bench-", dir=SPOOL_PARENT)
        spool_options = {"spool_dir": scratch.name, "spool_fsync": spool}
    config = ProducerConfig(
        region="us-east-1",
        endpoint_url=endpoint,
        rate_limit=1e9,  # limits off
        adaptive=adaptive,
        retry_budget=0.2 if adaptive else None,
        adaptive_batching=adaptive_batching,
        **spool_options,
        **CREDENTIALS,
    )
    data = b"x" * 100
    key_names = [f"device-{i}" for i in range(keys)]
    async with Producer(config) as producer:
        # warm up: shard map ready, connections open
        await producer.put_record(stream, data, partition_key="warm-up")
        if os.environ.get("BENCH_GC_FREEZE"):
            gc.freeze()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        failed = 0
        awaiting = None
        if await_each:
            # the idiomatic loop: a submit per record, then an await on every handle
            pending = [
                await producer.submit(stream, data, partition_key=key_names[i % keys])
                for i in range(records)
            ]
            awaited_at = time.perf_counter()
            for handle in pending:
                try:
                    await handle
                except RecordFailedError:
                    failed += 1
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            awaiting = round(time.perf_counter() - awaited_at, 3)
        elif batch:
            # a firehose that has its records in batches: submit_many, each batch's handle
            # checked as the oldest completes
            batches: deque[PendingBatch] = deque()
            for start in range(0, records, batch):
                batches.append(
                    await producer.submit_many(
                        stream,
                        [
                            (data, key_names[i % keys])
                            for i in range(start, min(records, start + batch))
                        ],
                    )
                )
                while batches and batches[0].done():
                    failed += batches.popleft().failed
            await producer.flush()
            failed += sum(len(b) - b.succeeded for b in batches)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        elif retain:
            # keep every handle until the end (the worst case for the garbage collector)
            pending = [
                await producer.submit(stream, data, partition_key=key_names[i % keys])
                for i in range(records)
            ]
            await producer.flush()
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            failed = sum(1 for p in pending if not p.done() or not p.result().success)
        else:
            # a firehose: check each result as soon as it is done, keep only the undone ones
            window: deque[PendingRecord] = deque()
            for i in range(records):
                window.append(
                    await producer.submit(stream, data, partition_key=key_names[i % keys])
                )
                while window and window[0].done():
                    failed += not window.popleft().result().success
            await producer.flush()
            failed += sum(1 for p in window if not p.result().success)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        kinesis_records = sum(
            shard.records_sent for shard in producer.statistics().streams[stream].shards.values()
        )
    if scratch is not None:
        scratch.cleanup()
    return {
        "records": records,
        "failed": failed,
        "seconds": round(wall, 3),
        **({} if awaiting is None else {"await_seconds": awaiting}),
        "records_per_second": round(records / wall),
        "cpu_seconds_per_100k": round(cpu / records * 100_000, 3),
        # the warm-up's record included
        "kinesis_records_per_user_record": round(kinesis_records / (records + 1), 4),
    }


def main() -> None:
    # GC tuning experiments (the CHANGELOG's measurements): BENCH_NO_GC=1 disables the cyclic
    # collector, BENCH_GC_THRESHOLD="g0,g1,g2" sets its thresholds, BENCH_GC_FREEZE=1 freezes
    # everything allocated at start-up (botocore's models) out of future collections.
    if os.environ.get("BENCH_NO_GC"):
        gc.disable()
    if threshold := os.environ.get("BENCH_GC_THRESHOLD"):
        gc.set_threshold(*(int(x) for x in threshold.split(",")))
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--keys", type=int, default=2_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--backend", choices=["asyncio", "trio", "both"], default="both")
    parser.add_argument(
        "--retain",
        action="store_true",
        help="keep every PendingRecord until the end instead of checking each as it completes",
    )
    parser.add_argument(
        "--await-each",
        action="store_true",
        help="submit every record, then await every handle (the idiomatic loop); reports the "
        "await phase as await_seconds",
    )
    parser.add_argument(
        "--features-off",
        dest="adaptive",
        action="store_false",
        help="adaptive=False and retry_budget=None: every rate-control feature beyond the KPL off",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=0,
        help="submit in batches of this many records with submit_many (0: one submit each)",
    )
    parser.add_argument(
        "--spool",
        default="none",
        help="comma-separated spool settings to run, interleaved: none (no spool_dir), or a "
        "spool_fsync value (off, interval, commit)",
    )
    parser.add_argument(
        "--kpl-batching",
        dest="adaptive_batching",
        action="store_false",
        help="adaptive_batching=False: every record waits for a full batch or its deadline",
    )
    parser.add_argument("--endpoint", default="emulator", type=check_endpoint, help=ENDPOINT_HELP)
    parser.add_argument("--profile", action="store_true", help="profile with pyinstrument")
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args()
    backends = ["asyncio", "trio"] if args.backend == "both" else [args.backend]
    results = {}
    with start_endpoint(args.endpoint) as endpoint:
        client = boto3.client(
            "kinesis", region_name="us-east-1", endpoint_url=endpoint, **CREDENTIALS
        )
        spools = args.spool.split(",")
        for backend, spool in [(b, s) for b in backends for s in spools]:
            stream = f"bench-{backend}-{spool}-{os.getpid()}-{int(time.time())}"
            client.create_stream(StreamName=stream, ShardCount=args.shards)
            client.get_waiter("stream_exists").wait(
                StreamName=stream, WaiterConfig={"Delay": 0.2, "MaxAttempts": 300}
            )
            if args.profile:
                from pyinstrument import Profiler

                profiler = Profiler(async_mode="disabled")
                profiler.start()
            result = anyio.run(
                run_once,
                endpoint,
                stream,
                args.records,
                args.keys,
                args.retain,
                args.adaptive,
                args.batch,
                spool,
                args.adaptive_batching,
                args.await_each,
                backend=backend,
            )
            if args.profile:
                profiler.stop()
                print(profiler.output_text(unicode=True, color=False, show_all=False))
            name = backend if len(spools) == 1 else f"{backend} spool={spool}"
            results[name] = result
            print(f"{name:8} {json.dumps(result)}", flush=True)
        if len(spools) > 1:
            for backend in backends:
                base = results[f"{backend} spool={spools[0]}"]["records_per_second"]
                for spool in spools[1:]:
                    rate = results[f"{backend} spool={spool}"]["records_per_second"]
                    print(f"{backend} spool={spool} / spool={spools[0]} = {rate / base:.2f}")
        elif len(results) == 2:
            ratio = results["trio"]["records_per_second"] / results["asyncio"]["records_per_second"]
            print(f"trio / asyncio = {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
