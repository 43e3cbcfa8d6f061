"""``anykpl fleet-allocator``: run a fleet's allocator on its own, without a producer.

Producers with a ``FleetConfig`` elect one of themselves as the allocator, so this command is
optional. It suits deployments that prefer the role in a process of its own: start it with
the fleet's bucket (or table), prefix and caps, and give the producers
``FleetConfig(elect=False)``. It competes for the allocator's lease like any member, so two
of them (or it and electing producers) are safe: one allocates, the others stand by and take
over within a lease.

It prints one line per generation of grants it writes: the workers, the grants, and their
sum against the cap. Ctrl-C (or SIGTERM) releases the lease and exits with status 0.
See docs/fleet.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import anyio

from .._fleet import FleetAllocator, GrantsDocument
from ..config import FleetConfig, ProducerConfig
from ..errors import ConfigError

__all__ = ("add_arguments", "describe", "run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    store = parser.add_mutually_exclusive_group(required=True)
    store.add_argument("--bucket", help="the S3 bucket of the fleet's objects")
    store.add_argument("--table", help="or the DynamoDB table (anykpl fleet-table create)")
    parser.add_argument("--prefix", default="anykpl-fleet", help="their key prefix")
    parser.add_argument(
        "--records-per-second", type=float, help="the fleet's cap in Kinesis records per second"
    )
    parser.add_argument("--bytes-per-second", type=float, help="the fleet's cap in bytes/s")
    parser.add_argument(
        "--sync-interval", type=float, default=5.0, help="seconds between allocations"
    )
    parser.add_argument(
        "--lease",
        type=float,
        help="seconds a lease and its grants last (default 3 intervals, at least 2)",
    )
    parser.add_argument(
        "--bootstrap-fraction",
        type=float,
        help="the bootstrap budget: the cap × this is left to the workers outside a grant "
        "(default 0.04, as FleetConfig); give the producers' value",
    )
    parser.add_argument("--endpoint-url", help="the store's endpoint, such as the emulator's URL")
    parser.add_argument("--region", help="the AWS region (default: botocore's chain)")
    parser.add_argument("--allocator-id", help="this allocator's name (default: random)")


def describe(document: GrantsDocument) -> str:
    """One line for a generation of grants."""
    granted = sorted((w, e.grant) for w, e in document.workers.items() if e.grant is not None)
    parts = [
        time.strftime("%H:%M:%S"),
        f"generation {document.generation}",
        f"{len(granted)} worker(s)",
    ]
    if not granted and document.fleet_size is not None:
        # the first allocator of a fleet, gathering every member's report for a cycle
        parts.append(f"no grants yet: {document.fleet_size} worker(s) reported")
        return " | ".join(parts)
    for index, unit in enumerate(("records/s", "bytes/s")):
        cap = document.cap[index]
        if cap is None:
            continue
        each = " ".join(f"{w}={g[index] or 0:.0f}" for w, g in granted)
        total = document.total_granted()[index] or 0.0
        in_force = document.total_reserved()[index] or 0.0
        parts.append(f"{unit} [{each}] sum {total:.0f} of {cap:.0f} (in force ≤ {in_force:.0f})")
    if document.learning:
        parts.append("learning")
    return " | ".join(parts)


def run(args: argparse.Namespace) -> int:
    optional = {}
    if args.bootstrap_fraction is not None:
        optional["bootstrap_fraction"] = args.bootstrap_fraction
    try:
        fleet = FleetConfig(
            bucket=args.bucket,
            table=args.table,
            prefix=args.prefix,
            records_per_second=args.records_per_second,
            bytes_per_second=args.bytes_per_second,
            sync_interval=args.sync_interval,
            lease=args.lease,
            endpoint_url=args.endpoint_url,
            **optional,
        )
        config = ProducerConfig(region=args.region)
    except ConfigError as exc:
        print(f"anykpl fleet-allocator: {exc}", file=sys.stderr)
        return 2
    allocator = FleetAllocator(
        fleet,
        config,
        allocator_id=args.allocator_id,
        on_allocation=lambda document: print(describe(document), flush=True),
    )
    where = (
        f"s3://{fleet.bucket}/{fleet.prefix}/"
        if fleet.table is None
        else f"dynamodb table {fleet.table}, prefix {fleet.prefix}"
    )
    print(
        f"anykpl fleet-allocator {allocator.worker_id}: {where} "
        f"every {fleet.sync_interval:g} s, lease {fleet.lease:g} s, bootstrap fraction "
        f"{fleet.bootstrap_fraction:g} (Ctrl-C to stop)",
        flush=True,
    )
    anyio.run(_serve, allocator)
    return 0


async def _serve(allocator: FleetAllocator) -> None:
    async with anyio.create_task_group() as tg:

        async def stop_on_signal() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    await allocator.aclose()  # releases the lease
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(stop_on_signal)
        await allocator.run()
        tg.cancel_scope.cancel()
