"""The blocking API from threads: ``SyncProducer`` as scripts and thread pools use it.

For each backend (``--backend``: asyncio, trio or both) and each thread count (``--threads``,
``1,8``), two modes, each on a fresh ``--shards``-shard stream (4) of the endpoint (the
emulator with limits off in its own process, moto's server, or a URL), a fresh
``SyncProducer`` with the defaults unless ``--set field=value`` says otherwise:

- ``submit``: the threads share ``--records`` records (20,000) of ``--size`` bytes (100), a
  ``submit`` each, keeping the futures; then every future's result is checked;
- ``put_record``: the threads share ``--put-records`` records (2,000), a blocking
  ``put_record`` each (the record is terminal before the thread puts its next).

Reported per case: records/s from constructing the ``SyncProducer`` to the last result (its
``close`` after that is timed apart), and CPU seconds of the process per 1,000 records. Every
record is read back (``anykpl.readback``, AWS's deaggregator); one missing or stored twice
fails the run. ::

    python benchmarks/sync_threads.py
    python benchmarks/sync_threads.py --backend trio --threads 16 --json sync.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any

import boto3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from anykpl import RecordResult, SyncProducer
from anykpl.readback import read_user_records
from endpoints import ENDPOINT_HELP, check_endpoint, start_endpoint

CREDENTIALS: dict[str, Any] = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}


def overrides(pairs: list[str]) -> dict[str, Any]:
    """``field=value`` pairs as ProducerConfig overrides (values as Python literals)."""
    result: dict[str, Any] = {}
    for pair in pairs:
        field, _, value = pair.partition("=")
        try:
            result[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            result[field] = value
    return result


def run_case(
    endpoint: str, stream: str, backend: str, mode: str, threads: int, count: int, args: Any
) -> tuple[dict[str, Any], Counter[bytes]]:
    """One case: the records/s and CPU it took, and what it sent (data → times)."""
    shares = [count // threads + (1 if t < count % threads else 0) for t in range(threads)]
    padding = b"x" * max(0, args.size - 16)
    futures: list[Future[RecordResult]] = []
    failures: list[BaseException] = []
    sent: Counter[bytes] = Counter()

    def work(thread: int, producer: SyncProducer) -> None:
        mine: list[Future[RecordResult]] = []
        try:
            for i in range(shares[thread]):
                data = b"%04d-%010d" % (thread, i) + padding
                if mode == "submit":
                    mine.append(producer.submit(stream, data, partition_key=f"{thread}-{i}"))
                else:
                    assert producer.put_record(stream, data, partition_key=f"{thread}-{i}").success
        except BaseException as exc:
            failures.append(exc)
        futures.extend(mine)

    cpu = time.process_time()
    started = time.perf_counter()
    producer = SyncProducer(
        backend=backend,
        region="us-east-1",
        endpoint_url=endpoint,
        **CREDENTIALS,
        **overrides(args.set),
    )
    try:
        workers = [threading.Thread(target=work, args=(t, producer)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        for future in futures:
            if not future.result().success:  # pragma: no cover - result() raises instead
                failures.append(RuntimeError("a record failed"))
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
    finally:
        closing = time.perf_counter()
        producer.close()
        closed_in = time.perf_counter() - closing
    if failures:
        raise SystemExit(f"{backend} {mode} {threads} threads: {failures[0]!r}")
    for thread, share in enumerate(shares):
        for i in range(share):
            sent[b"%04d-%010d" % (thread, i) + padding] += 1
    return {
        "backend": backend,
        "mode": mode,
        "threads": threads,
        "records": count,
        "records_per_s": count / elapsed,
        "cpu_s_per_1000": cpu / count * 1000,
        "close_s": closed_in,
    }, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="both", choices=("asyncio", "trio", "both"))
    parser.add_argument("--threads", default="1,8", help="thread counts, comma-separated")
    parser.add_argument("--records", type=int, default=20_000, help="records in submit mode")
    parser.add_argument("--put-records", type=int, default=2_000, help="in put_record mode")
    parser.add_argument("--size", type=int, default=100, help="bytes of data per record")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], help="field=value override")
    parser.add_argument("--endpoint", default="emulator", type=check_endpoint, help=ENDPOINT_HELP)
    parser.add_argument("--json", help="write results to this file")
    args = parser.parse_args()
    backends = ["asyncio", "trio"] if args.backend == "both" else [args.backend]
    thread_counts = [int(t) for t in args.threads.split(",")]
    results = []
    with start_endpoint(args.endpoint) as endpoint:
        client = boto3.client(
            "kinesis", region_name="us-east-1", endpoint_url=endpoint, **CREDENTIALS
        )
        for backend in backends:
            for mode, count in (("submit", args.records), ("put_record", args.put_records)):
                for threads in thread_counts:
                    stream = f"sync-{backend}-{mode}-{threads}-{os.getpid()}-{int(time.time())}"
                    client.create_stream(StreamName=stream, ShardCount=args.shards)
                    client.get_waiter("stream_exists").wait(
                        StreamName=stream, WaiterConfig={"Delay": 0.2, "MaxAttempts": 300}
                    )
                    result, sent = run_case(endpoint, stream, backend, mode, threads, count, args)
                    read = Counter(record.data for record in read_user_records(client, stream))
                    if read != sent:
                        missing = sum((sent - read).values())
                        extra = sum((read - sent).values())
                        raise SystemExit(
                            f"{stream}: read back {missing} missing, {extra} extra records"
                        )
                    result["read_back"] = sum(read.values())
                    results.append(result)
                    print(
                        f"{backend:8} {mode:10} {threads:3} threads: "
                        f"{result['records_per_s']:9,.0f} records/s, "
                        f"{result['cpu_s_per_1000']:.3f} CPU s per 1,000, "
                        f"close {result['close_s']:.2f} s, read back {result['read_back']:,}",
                        flush=True,
                    )
    print()
    print("| backend | mode | threads | records/s | CPU s per 1,000 records |")
    print("|---|---|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['backend']} | `{r['mode']}` | {r['threads']} | {r['records_per_s']:,.0f} "
            f"| {r['cpu_s_per_1000']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
