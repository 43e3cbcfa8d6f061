"""One producer of a fleet, in its own process (tests/integration/test_fleet.py and
benchmarks/fleet_cap.py start several).

It puts records as fast as its producer admits them for ``--duration`` seconds, under a
``FleetConfig``, then closes and prints one JSON line: the payloads acknowledged, the failures,
when it started and stopped putting (``time.time()``), and its fleet statistics along the way.
Payloads are ``b"<worker>-<n>|"`` padded to ``--size`` bytes, so a reader can check every
acknowledged record arrived.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import anyio

from anykpl import FleetConfig, PendingRecord, Producer, ProducerConfig, errors


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--s3-endpoint", help="the store's endpoint, if not --endpoint")
    parser.add_argument("--stream", required=True)
    store = parser.add_mutually_exclusive_group(required=True)
    store.add_argument("--bucket", help="the fleet's S3 bucket")
    store.add_argument("--table", help="or its DynamoDB table")
    parser.add_argument("--prefix", default="anykpl-fleet")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--records-per-second", type=float)
    parser.add_argument("--bytes-per-second", type=float)
    parser.add_argument("--sync-interval", type=float, default=0.5)
    parser.add_argument("--lease", type=float)
    parser.add_argument("--safe-fraction", type=float, default=0.0)
    parser.add_argument("--no-elect", action="store_true")
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--aggregation", action="store_true")
    parser.add_argument("--max-outstanding", type=int, default=300)
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--report-ids", action="store_true", help="print every payload id")
    return parser.parse_args(argv)


async def produce(args: argparse.Namespace) -> dict[str, Any]:
    fleet = FleetConfig(
        bucket=args.bucket,
        table=args.table,
        prefix=args.prefix,
        records_per_second=args.records_per_second,
        bytes_per_second=args.bytes_per_second,
        sync_interval=args.sync_interval,
        lease=args.lease,
        worker_id=args.worker_id,
        endpoint_url=args.s3_endpoint or args.endpoint,
        elect=not args.no_elect,
        safe_fraction=args.safe_fraction,
    )
    config = ProducerConfig(
        region="us-east-1",
        endpoint_url=args.endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        aggregation_enabled=args.aggregation,
        record_max_buffered_time=0.05,
        max_outstanding_records=args.max_outstanding,
        close_timeout=20.0,
        fleet=fleet,
    )
    pendings: list[tuple[str, PendingRecord]] = []
    samples: list[dict[str, Any]] = []
    pad = b"x" * args.size

    async with Producer(config) as producer, anyio.create_task_group() as tg:

        async def sample() -> None:
            while True:
                stats = producer.statistics().fleet
                if stats is not None:
                    samples.append(
                        {
                            "t": time.time(),
                            "mode": stats.mode,
                            "role": stats.role,
                            "records_per_second": stats.records_per_second,
                            "bytes_per_second": stats.bytes_per_second,
                            "generation": stats.generation,
                            "errors": stats.s3_errors,
                        }
                    )
                await anyio.sleep(min(0.25, args.sync_interval / 4))

        sampler = anyio.CancelScope()

        async def run_sampler() -> None:
            with sampler:
                await sample()

        tg.start_soon(run_sampler)
        started = time.time()
        deadline = anyio.current_time() + args.duration
        n = 0
        while anyio.current_time() < deadline:
            uid = f"{args.worker_id}-{n}"
            data = (uid + "|").encode() + pad[: max(0, args.size - len(uid) - 1)]
            pendings.append((uid, await producer.submit(args.stream, data, partition_key=uid)))
            n += 1
        stopped = time.time()
        await producer.flush()
        sampler.cancel()
    acknowledged = [uid for uid, p in pendings if p.done() and _succeeded(p)]
    failed = len(pendings) - len(acknowledged)
    return {
        "worker_id": args.worker_id,
        "backend": args.backend,
        "submitted": n,
        "acknowledged": len(acknowledged),
        "ids": acknowledged if args.report_ids else [],
        "failed": failed,
        "started": started,
        "stopped": stopped,
        "samples": samples,
    }


def _succeeded(pending: PendingRecord) -> bool:
    try:
        return pending.result().success
    except errors.RecordFailedError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = anyio.run(produce, args, backend=args.backend)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
