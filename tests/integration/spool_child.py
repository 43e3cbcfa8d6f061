"""A producer with a spool, in its own process, that dies by ``kill -9`` (tests/integration/
test_spool.py and benchmarks/spool_crash.py start it).

It submits ``--records`` records as fast as admission allows. After each ``submit`` returns,
the number returned so far is stored in ``--progress`` (an 8-byte file mapped into memory: the
store survives the kill, as the spool's own entries do). Then, by ``--kill``:

- ``after:N``: the process kills itself (SIGKILL) as the N-th submit returns;
- ``append:N``: the N-th append to the spool is torn (its data half-written) and the process
  is killed in the middle of it, before that submit returns;
- ``request:N``: the process is killed as the N-th PutRecords response arrives, before the
  producer has seen it (those records are in the stream, and will be sent again);
- ``end``: killed after the last submit returns, before any flush;
- ``none``: flushes and closes normally.

Record ``uid`` has partition key ``k<uid % 97>`` and data ``payload(uid, size)`` below.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import struct
from typing import Any

import anyio

from anykpl import Producer, ProducerConfig


def payload(uid: int, size: int) -> bytes:
    """``size`` bytes that start with the record's unique id: ``b"0000042|....."``."""
    return f"{uid:07d}|".encode().ljust(size, b".")


def partition_key(uid: int) -> str:
    return f"k{uid % 97}"


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(kill: str) -> tuple[str, int]:
    mode, _, count = kill.partition(":")
    n = int(count) if count else 0
    if mode == "append":
        from anykpl._runtime._spool import Spool

        original_append = Spool.append
        calls = [0]

        def torn_append(self: Spool, record: Any) -> None:
            calls[0] += 1
            original_append(self, record)
            if calls[0] == n:
                # the entry's last bytes never made it: a copy cut short by the kill
                segment = record.spool_segment
                mm = segment.mm
                tail = max(1, len(record.data) // 2)
                mm[segment.pos - tail : segment.pos] = b"\0" * tail
                die()

        Spool.append = torn_append  # type: ignore[method-assign]
    elif mode == "request":
        from anykpl._transport._botocore import _BotocoreTransport

        original_put = _BotocoreTransport.put_records
        responses = [0]

        async def put_then_die(self: Any, stream: str, records: Any) -> Any:
            response = await original_put(self, stream, records)
            responses[0] += 1
            if responses[0] == n:
                die()
            return response

        _BotocoreTransport.put_records = put_then_die  # type: ignore[method-assign]
    return mode, n


async def run(args: argparse.Namespace) -> None:
    mode, n = arm(args.kill)
    fd = os.open(args.progress, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 8)
    progress = mmap.mmap(fd, 8)
    config = ProducerConfig(
        region="us-east-1",
        endpoint_url=args.endpoint,
        aws_access_key_id="spool",
        aws_secret_access_key="spool",
        spool_dir=args.spool_dir,
        spool_fsync=args.fsync,
    )
    async with Producer(config) as producer:
        for uid in range(args.records):
            await producer.submit(args.stream, payload(uid, args.size), partition_key(uid))
            struct.pack_into("<Q", progress, 0, uid + 1)
            if mode == "after" and uid + 1 == n:
                die()
        if mode == "end":
            die()
        await producer.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--stream", required=True)
    parser.add_argument("--spool-dir", required=True)
    parser.add_argument("--progress", required=True)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=100)
    parser.add_argument("--kill", default="none")
    parser.add_argument("--fsync", default="off")
    parser.add_argument("--backend", default="asyncio")
    args = parser.parse_args()
    anyio.run(run, args, backend=args.backend)


if __name__ == "__main__":
    main()
