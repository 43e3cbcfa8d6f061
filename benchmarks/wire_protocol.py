"""JSON against CBOR on the wire (``wire_protocol``): bytes sent and CPU per record.

For each record size (``--sizes``, bytes of data: 100, 1024 and 10240), each backend and each
protocol (``json``, ``cbor``), interleaved over ``--rounds`` rounds, a fresh producer in a fresh
child process puts ``--megabytes`` MB of records (at least 2,000), each under a key of its own
drawn from 1,000, with ``submit_many`` in batches of 500 (the firehose's way), against one
endpoint started for the whole run (the emulator, limits off, in its own process; or a URL of an
endpoint that speaks CBOR). Each stream's first PutRecords goes through botocore in JSON either
way (anykpl learns the request's route from it): one record is put and acknowledged before the
clock starts.

Reported per case: user records/s (from the first ``submit_many`` to the last result), CPU
seconds of the child per 100,000 records over the same span, and the PutRecords bodies' bytes
per user record (every body the producer wrote, counted where it is written). Then every record
is read back and deaggregated with AWS's ``aws_kinesis_agg``: a failed record, or an
acknowledged one missing or unexpected, fails the run (exit status 1). ::

    python benchmarks/wire_protocol.py
    python benchmarks/wire_protocol.py --sizes 1024 --backend trio --rounds 3 --json wire.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from endpoints import CREDENTIALS, REGION, client_for, read_back, start_endpoint

CASE_TIMEOUT = 600.0
BATCH = 500


def records(size: int, count: int, seed: int) -> list[tuple[bytes, str]]:
    """(data, partition key): ``size`` bytes each, its index first, keys from 1,000."""
    rng = random.Random(seed)
    filler = bytes(rng.randrange(256) for _ in range(size))
    return [
        ((b"%09d|" % i + filler)[:size].ljust(size, b"."), f"device-{rng.randrange(1000):04d}")
        for i in range(count)
    ]


def run_child(case: dict[str, Any]) -> None:
    import anyio

    from anykpl import Producer, ProducerConfig
    from anykpl._transport import _botocore, _cbor

    written = [0]
    for module in (_botocore, _cbor):
        original = module.put_records_body_parts

        def counted(parameters: Any, _original: Any = original) -> list[bytes]:
            parts: list[bytes] = _original(parameters)
            written[0] += sum(len(part) for part in parts)
            return parts

        module.put_records_body_parts = counted  # type: ignore[attr-defined]

    items = records(case["size"], case["records"], case["seed"])

    async def main() -> dict[str, Any]:
        config = ProducerConfig(
            region=REGION,
            endpoint_url=case["endpoint"],
            rate_limit=1e9,  # limits off
            wire_protocol=case["protocol"],
            **CREDENTIALS,
        )
        async with Producer(config) as producer:
            await producer.put_record(case["stream"], b"warm-up", "warm-up")
            written[0] = 0
            cpu0, wall0 = time.process_time(), time.perf_counter()
            batches = [
                await producer.submit_many(case["stream"], items[start : start + BATCH])
                for start in range(0, len(items), BATCH)
            ]
            failed = 0
            for batch in batches:
                failed += (await batch).failed
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        return {"failed": failed, "seconds": wall, "cpu": cpu, "body_bytes": written[0]}

    print("RESULT " + json.dumps(anyio.run(main, backend=case["backend"])), flush=True)


def measure(case: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=CASE_TIMEOUT, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise RuntimeError(f"case {case} failed: {done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1024,10240", help="bytes of data per record")
    parser.add_argument("--megabytes", type=float, default=40.0, help="MB of data per case (40)")
    parser.add_argument("--backend", default="both", choices=("asyncio", "trio", "both"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--endpoint", default="emulator", help="'emulator' or a URL")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    from anykpl._compat import build_kind

    backends = ["asyncio", "trio"] if args.backend == "both" else [args.backend]
    sizes = [int(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    run = f"{os.getpid()}-{int(time.time())}"
    with start_endpoint(args.endpoint) as endpoint:
        client = client_for(endpoint)
        number = 0
        for round_ in range(1, args.rounds + 1):
            for size in sizes:
                count = max(2_000, int(args.megabytes * 1e6 / size))
                for backend in backends:
                    for protocol in ("json", "cbor"):
                        number += 1
                        stream = f"wire-{run}-{number}"
                        client.create_stream(StreamName=stream, ShardCount=4)
                        client.get_waiter("stream_exists").wait(
                            StreamName=stream, WaiterConfig={"Delay": 0.2, "MaxAttempts": 300}
                        )
                        case = {
                            "endpoint": endpoint,
                            "stream": stream,
                            "backend": backend,
                            "protocol": protocol,
                            "size": size,
                            "records": count,
                            "seed": number,
                        }
                        result = measure(case)
                        found = read_back(client, stream)
                        expected = Counter(
                            (key, data) for data, key in records(size, count, number)
                        )
                        expected[("warm-up", b"warm-up")] += 1
                        missing = sum((expected - found).values())
                        unexpected = sum((found - expected).values())
                        if result["failed"] or missing or unexpected:
                            problems.append(
                                f"{backend} {protocol} {size} B: {result['failed']} failed, "
                                f"{missing} missing, {unexpected} unexpected"
                            )
                        row = {
                            "round": round_,
                            "size": size,
                            "backend": backend,
                            "protocol": protocol,
                            "records": count,
                            "records_per_second": count / result["seconds"],
                            "cpu_per_100k": result["cpu"] / count * 100_000,
                            "body_bytes_per_record": result["body_bytes"] / count,
                            "missing": missing,
                        }
                        rows.append(row)
                        print(
                            f"round {round_} {size:6} B {backend:7} {protocol:4}: "
                            f"{row['records_per_second']:9,.0f} records/s, "
                            f"CPU {row['cpu_per_100k']:6.2f} s per 100k, "
                            f"{row['body_bytes_per_record']:8.1f} body bytes per record",
                            flush=True,
                        )
    print(f"\n{build_kind()} build, {len(rows)} cases")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"build": build_kind(), "rows": rows, "problems": problems}, out, indent=1)
    if problems:
        print("PROBLEMS:\n  " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(1)
    print("every record read back")


if __name__ == "__main__":
    main()
