"""``anykpl emulator-stats``: what a running emulator has seen, per shard, as a table or JSON.

Reads ``GET /_anykpl/stats`` from the emulator at ``--endpoint`` (``docs/emulator.md``): the
requests it answered, and per shard the records and bytes it accepted, throttled and failed
since it started (or since ``--reset``). ``--json`` prints the whole document, per-second rows
included, for scripts; ``--watch SECONDS`` prints the table again every so many seconds until
interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..emulator import EmulatorClient, EmulatorControlError

__all__ = ("add_arguments", "run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        default="http://127.0.0.1:4567",
        metavar="URL",
        help="the emulator's URL (default http://127.0.0.1:4567, anykpl emulator's default)",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument(
        "--json", action="store_true", help="print the statistics as one JSON document"
    )
    output.add_argument(
        "--watch",
        type=_positive,
        default=None,
        metavar="SECONDS",
        help="print the table again every SECONDS until interrupted",
    )
    parser.add_argument(
        "--reset", action="store_true", help="zero the counters after printing them"
    )


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def run(args: argparse.Namespace) -> int:
    """Print the statistics; 0, or 1 when the emulator cannot be reached."""
    client = EmulatorClient(args.endpoint)
    try:
        while True:
            stats = client.stats()
            if args.json:
                json.dump(stats, sys.stdout, indent=2)
                print()
            else:
                print(table(stats), flush=True)
            if args.reset:
                client.reset_stats()
            if args.watch is None:
                return 0
            time.sleep(args.watch)
            print(flush=True)
    except KeyboardInterrupt:
        return 0
    except (EmulatorControlError, OSError) as exc:
        print(f"anykpl emulator-stats: cannot read {args.endpoint}: {exc}", file=sys.stderr)
        return 1


def table(stats: dict[str, Any]) -> str:
    """The statistics as a plain-text table, a line per shard and a total."""
    totals = stats["totals"]
    limits = stats["limits"]
    state = (
        f"limits {limits['records_per_second']:,.0f} records/s and "
        f"{limits['bytes_per_second']:,.0f} B/s per shard"
        if limits["enabled"]
        else "limits off"
    )
    lines = [
        f"up {stats['uptime']:.0f} s, {state}; {totals['requests']:,} requests "
        f"({totals['request_errors']:,} answered with an error, {totals['resets']:,} reset)",
        "",
        f"{'stream':<20} {'shard':<22} {'open':<5}{'accepted':>10}{'MiB':>9}"
        f"{'throttled':>11}{'failed':>8}",
    ]
    for shard in stats["shards"]:
        lines.append(
            f"{shard['stream'][:20]:<20} {shard['shard_id']:<22} "
            f"{'yes' if shard['open'] else 'no':<5}{shard['accepted_records']:>10,}"
            f"{shard['accepted_bytes'] / 1048576:>9.1f}{shard['throttled_records']:>11,}"
            f"{shard['failed_records']:>8,}"
        )
    lines.append(
        f"{'total':<20} {'':<22} {'':<5}{totals['accepted_records']:>10,}"
        f"{totals['accepted_bytes'] / 1048576:>9.1f}{totals['throttled_records']:>11,}"
        f"{totals['failed_records']:>8,}"
    )
    return "\n".join(lines)
