"""A local Kinesis (and S3, and everything else moto serves) on one port, enforcing each shard's
write limits (1,000 records/s and 1 MiB/s, per record, like the service) and injecting faults on
request. Any AWS client talks to it with ``endpoint_url=http://HOST:PORT`` and any credentials.
Control it at run time through ``/_anykpl/`` (``anykpl.emulator.EmulatorClient``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

from ._options import Faults, HttpLimits, Limits, Reshard, Storm

_T = TypeVar("_T")


def _streams(spec: str) -> dict[str, int]:
    streams = {}
    for item in filter(None, spec.split(",")):
        name, _, count = item.partition(":")
        try:
            shards = int(count or 1)
        except ValueError:
            shards = 0
        if not name or shards < 1:
            raise argparse.ArgumentTypeError(
                f"{item!r} is not NAME or NAME:SHARDS with SHARDS a whole number from 1"
            )
        streams[name] = shards
    return streams


def _share(text: str) -> float:
    """A share of requests or records: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


def _spec(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """``parse``, with its ValueError's message kept (argparse would only say "invalid
    parse value")."""

    def checked(spec: str) -> _T:
        try:
            return parse(spec)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    parser.add_argument("--port", type=int, default=4567, help="port to listen on (4567)")
    parser.add_argument("--region", default="us-east-1", help="region of --streams (us-east-1)")
    parser.add_argument(
        "--streams",
        type=_streams,
        default={},
        metavar="NAME:SHARDS,...",
        help="streams to create at start, e.g. demo:4,other:2",
    )
    limits = parser.add_argument_group("shard limits")
    limits.add_argument("--no-limits", action="store_true", help="accept any rate")
    limits.add_argument(
        "--records-per-second",
        type=float,
        default=Limits.records_per_second,
        help="records per second per shard (1000)",
    )
    limits.add_argument(
        "--bytes-per-second",
        type=float,
        default=Limits.bytes_per_second,
        help="bytes (data + partition key) per second per shard (1048576)",
    )
    faults = parser.add_argument_group("faults (PutRecord and PutRecords only)")
    faults.add_argument(
        "--error-rate", type=_share, default=0.0, help="share of requests answered 500/503"
    )
    faults.add_argument(
        "--record-failure-rate",
        type=_share,
        default=0.0,
        help="share of records answered InternalFailure",
    )
    faults.add_argument(
        "--record-throttle-rate",
        type=_share,
        default=0.0,
        help="share of records answered ProvisionedThroughputExceededException, whatever the rate",
    )
    faults.add_argument("--latency", type=float, default=0.0, help="seconds added to each request")
    faults.add_argument(
        "--latency-jitter", type=float, default=0.0, help="up to this many seconds more, at random"
    )
    faults.add_argument(
        "--reset-rate", type=_share, default=0.0, help="share of requests whose connection is reset"
    )
    faults.add_argument(
        "--fault-after-write",
        type=_share,
        default=0.5,
        help="share of request errors and resets that happen after storing",
    )
    faults.add_argument("--seed", type=int, default=None, help="seed of the fault dice")
    faults.add_argument(
        "--storm",
        type=_spec(Storm.parse),
        action="append",
        default=[],
        metavar="STREAM:SHARD|*:START:DURATION[:FACTOR]",
        help="cut a shard's limits to FACTOR (0.1) for DURATION s from START s",
    )
    faults.add_argument(
        "--reshard",
        type=_spec(Reshard.parse),
        action="append",
        default=[],
        metavar="STREAM:split|merge:SHARD|*:AT or STREAM:scale:N:AT",
        help="reshard at AT seconds after start",
    )
    http = parser.add_argument_group("HTTP server")
    http.add_argument(
        "--max-body-bytes",
        type=int,
        default=HttpLimits.max_body_bytes,
        help="largest request body accepted; a larger one is answered 413 (33554432)",
    )
    http.add_argument(
        "--read-timeout",
        type=float,
        default=HttpLimits.read_timeout,
        help="seconds before an idle connection is closed or a stalled request answered 408 (60)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="log control events")


def run(args: argparse.Namespace) -> int:
    from ._server import EmulatorServer

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
    )
    limits = Limits(
        enabled=not args.no_limits,
        records_per_second=args.records_per_second,
        bytes_per_second=args.bytes_per_second,
    )
    faults = Faults(
        error_rate=args.error_rate,
        record_failure_rate=args.record_failure_rate,
        record_throttle_rate=args.record_throttle_rate,
        latency=args.latency,
        latency_jitter=args.latency_jitter,
        reset_rate=args.reset_rate,
        fault_after_write=args.fault_after_write,
        seed=args.seed,
    )

    try:
        http = HttpLimits(max_body_bytes=args.max_body_bytes, read_timeout=args.read_timeout)
    except ValueError as exc:
        print(f"anykpl emulator: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        server = EmulatorServer(limits=limits, faults=faults, region=args.region, http=http)
        server.set_up(args.streams, args.storm, args.reshard)
        port = await server.start(args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        state = "off"
        if limits.enabled:
            state = f"{limits.records_per_second:g} records/s and {limits.bytes_per_second:g} B/s"
        print(f"anykpl emulator on http://{args.host}:{port} (limits: {state})", flush=True)
        try:
            await stop.wait()
        finally:
            await server.close()

    asyncio.run(serve())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anykpl.emulator", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
