"""CPU per PutRecords request in the producer's process: through the SDK, and direct.

A stream's first PutRecords goes through aiobotocore whole; its later ones are built, signed and
sent by the transport through the client's HTTP session (docs/stages/sender.md, "Direct
requests"). This times ``--requests`` calls of the transport's ``put_records`` each way, one
after the other and alternating ``--rounds`` times, against the emulator (limits off, in its
own process) or another endpoint, with ``--records`` records of ``--size`` bytes a request
(the default, 4 × 45,000 B, is what a firehose of 100-byte records sends: four 45 KB
aggregates). Reports wall and CPU milliseconds per request, best round of each.

    python benchmarks/request_cost.py
    python benchmarks/request_cost.py --size 100 --backend trio
    python benchmarks/request_cost.py --endpoint moto
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import anyio

from endpoints import ENDPOINT_HELP, check_endpoint, start_endpoint

REGION = "us-east-1"
CREDENTIALS = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}


async def measure(endpoint: str, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    import boto3

    from anykpl import ProducerConfig
    from anykpl._transport._botocore import open_transport

    stream = f"request-cost-{time.monotonic_ns()}"
    client = boto3.client("kinesis", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS)
    client.create_stream(StreamName=stream, ShardCount=4)
    client.get_waiter("stream_exists").wait(StreamName=stream)
    records = [
        {"Data": os.urandom(args.size), "PartitionKey": f"key-{i}"} for i in range(args.records)
    ]
    config = ProducerConfig(region=REGION, endpoint_url=endpoint, **CREDENTIALS)
    results: dict[str, list[tuple[float, float]]] = {"sdk": [], "direct": []}
    async with open_transport(config) as transport:
        direct: Any = getattr(transport, "_direct", None)
        await transport.put_records(stream, records)  # teaches the stream's route
        if direct is None or stream not in direct.routes:
            raise SystemExit("this transport sends no direct requests")
        for _ in range(args.rounds):
            for mode in ("sdk", "direct"):
                transport._direct = None if mode == "sdk" else direct  # type: ignore[attr-defined]
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(args.requests):
                    response = await transport.put_records(stream, records)
                    assert response["FailedRecordCount"] == 0
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                results[mode].append((1000 * wall / args.requests, 1000 * cpu / args.requests))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", type=check_endpoint, default="emulator", help=ENDPOINT_HELP)
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--requests", type=int, default=200, help="per round and mode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--records", type=int, default=4, help="records a request")
    parser.add_argument("--size", type=int, default=45_000, help="bytes of each record's data")
    args = parser.parse_args()
    with start_endpoint(args.endpoint) as endpoint:
        results = anyio.run(measure, endpoint, args, backend=args.backend)
    kb = args.records * args.size / 1000
    print(f"{args.backend}, {args.records} × {args.size:,} B ({kb:,.1f} kB) a request:")
    for mode, rounds in results.items():
        wall = min(w for w, _ in rounds)
        cpu = min(c for _, c in rounds)
        print(
            f"  {mode:>6}: {wall:.2f} ms wall, {cpu:.2f} ms CPU per request (best of {len(rounds)})"
        )


if __name__ == "__main__":
    main()
