"""The blocking API from threads: ``SyncProducer`` as scripts and thread pools use it.

For each backend (``--backend``: asyncio, trio or both) and each thread count (``--threads``,
``1,8``), two modes:

- ``submit``: the threads share ``--records`` records (20,000) of ``--size`` bytes (100), a
  ``submit`` each, keeping the futures; once the threads have joined, every future's result is
  checked;
- ``put_record``: the threads share ``--put-records`` records (2,000), a blocking
  ``put_record`` each (the record is terminal before the thread puts its next).

Every case is a fresh ``SyncProducer`` (the defaults unless ``--set field=value`` says
otherwise) in a fresh child process, on a fresh ``--shards``-shard stream (4) of one endpoint
started for the whole run: the emulator with limits off in its own process (the default), moto's
server, or a URL. Every record has a partition key and data of its own.

Reported per case: records/s, from constructing the ``SyncProducer`` to the last result (its
``close`` after that is timed apart), and CPU seconds of the child process (every thread of it)
per 1,000 records over the same span. Then every record is read back from the stream and
deaggregated with AWS's ``aws_kinesis_agg`` (and counted again with ``anykpl.readback``, which
must agree): a failed record, or an acknowledged one missing, stored twice or unexpected, fails
the run (exit status 1). ::

    python benchmarks/sync_threads.py
    python benchmarks/sync_threads.py --backend trio --threads 1,4,16 --json sync.json
    python benchmarks/sync_threads.py --set adaptive_batching=False --endpoint moto
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from endpoints import (
    CREDENTIALS,
    ENDPOINT_HELP,
    REGION,
    check_endpoint,
    client_for,
    overrides,
    read_back,
    start_endpoint,
)

#: a case's child process is given up on after this many seconds
CASE_TIMEOUT = 600.0


def shares(count: int, threads: int) -> list[int]:
    """How many of ``count`` records each of ``threads`` threads puts."""
    return [count // threads + (1 if t < count % threads else 0) for t in range(threads)]


def record(thread: int, index: int, size: int) -> tuple[str, bytes]:
    """(partition key, data) of thread ``thread``'s record ``index``: unique, ``size`` bytes
    (or the id alone, if that is longer)."""
    return f"t{thread}-{index}", f"{thread}:{index}:".encode().ljust(size, b".")


# --- the child: one case, measured --------------------------------------------------------------


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Put the case's records from its threads; the figures, and the records that failed."""
    from anykpl import RecordResult, SyncProducer

    stream, mode, size = case["stream"], case["mode"], case["size"]
    counts = shares(case["records"], case["threads"])
    pending: list[list[tuple[int, Future[RecordResult]]]] = [[] for _ in counts]
    failed: list[tuple[int, int]] = []  # (thread, index)
    errors: list[str] = []

    def fail(thread: int, index: int, exc: BaseException) -> None:
        failed.append((thread, index))  # list.append is atomic: no lock needed
        if len(errors) < 5:
            errors.append(f"thread {thread} record {index}: {exc!r}")

    def work(thread: int, producer: SyncProducer) -> None:
        mine = pending[thread]
        for index in range(counts[thread]):
            key, data = record(thread, index, size)
            try:
                if mode == "submit":
                    mine.append((index, producer.submit(stream, data, partition_key=key)))
                else:
                    result = producer.put_record(stream, data, partition_key=key)
                    if not result.success:  # put_record raises instead; checked all the same
                        fail(thread, index, RuntimeError(f"not put: {result}"))
            except Exception as exc:
                fail(thread, index, exc)

    cpu_started = time.process_time()
    started = time.perf_counter()
    producer = SyncProducer(
        backend=case["backend"],
        region=REGION,
        endpoint_url=case["endpoint"],
        **CREDENTIALS,
        **overrides(case["set"]),
    )
    try:
        opened = time.perf_counter() - started
        workers = [
            threading.Thread(target=work, args=(thread, producer), name=f"bench-{thread}")
            for thread in range(len(counts))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        for thread, futures in enumerate(pending):
            for index, future in futures:
                try:
                    if not future.result().success:
                        fail(thread, index, RuntimeError(f"not put: {future.result()}"))
                except Exception as exc:
                    fail(thread, index, exc)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
    finally:
        closing = time.perf_counter()
        producer.close()
        closed_in = time.perf_counter() - closing
    return {
        "records_per_s": case["records"] / elapsed,
        "cpu_s_per_1000": 1000 * cpu / case["records"],
        "seconds": elapsed,
        "open_s": opened,
        "close_s": closed_in,
        "failed": sorted(failed),
        "errors": errors,
    }


def run_child(case: dict[str, Any]) -> None:
    print(json.dumps(run_case(case)))


# --- the parent: streams, children, read-back ---------------------------------------------------


def check(client: Any, case: dict[str, Any], result: dict[str, Any]) -> list[str]:
    """What is wrong with the case, from its failures and the stream read back: nothing, if
    every record was acknowledged and is in the stream exactly once."""
    from anykpl.readback import count_user_records, judge

    stream = case["stream"]
    failed = {record(thread, index, case["size"]) for thread, index in result["failed"]}
    everything = [
        record(thread, index, case["size"])
        for thread, count in enumerate(shares(case["records"], case["threads"]))
        for index in range(count)
    ]
    acknowledged = [r for r in everything if r not in failed]
    found = read_back(client, stream)
    verdict = judge(acknowledged, found, failed)
    result["read_back"] = sum(found.values())
    problems = []
    if failed:
        problems.append(f"{len(failed)} records failed, e.g. {'; '.join(result['errors'])}")
    if verdict.missing:
        problems.append(
            f"{verdict.missing} acknowledged records missing, e.g. {list(verdict.examples_missing)}"
        )
    if verdict.duplicates:
        twice = [key for key, copies in found.items() if copies > 1][:5]
        problems.append(f"{verdict.duplicates} extra copies, e.g. of {twice}")
    if verdict.unexpected:
        problems.append(
            f"{verdict.unexpected} records nobody put, e.g. {list(verdict.examples_unexpected)}"
        )
    by_anykpl, _ = count_user_records(client, stream)
    if by_anykpl != found:
        problems.append(
            f"anykpl.readback counts {sum(by_anykpl.values())} user records "
            f"({len(by_anykpl)} distinct), aws_kinesis_agg {sum(found.values())} ({len(found)})"
        )
    return [f"{stream}: {problem}" for problem in problems]


def measure(case: dict[str, Any]) -> dict[str, Any]:
    """Run ``case`` in a child process; its figures."""
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, check=False, timeout=CASE_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"{case['backend']} {case['mode']} {case['threads']} threads: no result after "
            f"{CASE_TIMEOUT:g} s"
        ) from None
    if done.returncode:
        raise SystemExit(
            f"{case['backend']} {case['mode']} {case['threads']} threads: the child process "
            f"failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    if done.stderr.strip():
        print(done.stderr.rstrip(), file=sys.stderr)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def table(results: list[dict[str, Any]], args: argparse.Namespace, build: str) -> str:
    settings = ", ".join(args.set) or "defaults"
    lines = [
        f"### {args.endpoint}, {build}, {args.shards} shards, {args.size} B records, "
        f"{args.records:,} records for submit, {args.put_records:,} for put_record, {settings}",
        "",
        "| backend | mode | threads | records/s | CPU s per 1,000 records | close s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['backend']} | `{r['mode']}` | {r['threads']} | {r['records_per_s']:,.0f} "
            f"| {r['cpu_s_per_1000']:.3f} | {r['close_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="both", choices=("asyncio", "trio", "both"))
    parser.add_argument("--threads", default="1,8", help="thread counts, comma-separated (1,8)")
    parser.add_argument("--records", type=int, default=20_000, help="records for submit (20,000)")
    parser.add_argument(
        "--put-records", type=int, default=2_000, help="records for put_record (2,000)"
    )
    parser.add_argument("--size", type=int, default=100, help="bytes of data per record (100)")
    parser.add_argument("--shards", type=int, default=4, help="shards of each case's stream (4)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="a config override"
    )
    parser.add_argument("--endpoint", default="emulator", type=check_endpoint, help=ENDPOINT_HELP)
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    backends = ["asyncio", "trio"] if args.backend == "both" else [args.backend]
    try:
        thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads: comma-separated numbers, not {args.threads!r}")
    if min(thread_counts) < 1 or min(args.records, args.put_records) < 1:
        parser.error("--threads, --records and --put-records must be at least 1")
    from anykpl._compat import build_kind

    build = build_kind()
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    run = f"{os.getpid()}-{int(time.time())}"
    with start_endpoint(args.endpoint) as endpoint:
        client = client_for(endpoint)
        number = 0
        for backend in backends:
            for mode, count in (("submit", args.records), ("put_record", args.put_records)):
                for threads in thread_counts:
                    number += 1
                    stream = f"sync-{run}-{number}-{backend}-{mode}-{threads}"
                    client.create_stream(StreamName=stream, ShardCount=args.shards)
                    client.get_waiter("stream_exists").wait(
                        StreamName=stream, WaiterConfig={"Delay": 0.2, "MaxAttempts": 300}
                    )
                    case = {
                        "endpoint": endpoint,
                        "stream": stream,
                        "backend": backend,
                        "mode": mode,
                        "threads": threads,
                        "records": count,
                        "size": args.size,
                        "set": args.set,
                    }
                    result = measure(case)
                    wrong = check(client, case, result)
                    problems.extend(wrong)
                    results.append(
                        {"backend": backend, "mode": mode, "threads": threads, "records": count}
                        | result
                        | {"ok": not wrong}
                    )
                    print(
                        f"{backend:8} {mode:10} {threads:3} threads: "
                        f"{result['records_per_s']:9,.0f} records/s, "
                        f"{result['cpu_s_per_1000']:.3f} CPU s per 1,000, "
                        f"open {result['open_s']:.2f} s, close {result['close_s']:.2f} s, "
                        f"read back {result['read_back']:,}{'' if not wrong else ', WRONG'}",
                        file=sys.stderr,
                        flush=True,
                    )
    print(table(results, args, build))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    if problems:
        print("\n".join(["", "FAILED:", *problems]), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
