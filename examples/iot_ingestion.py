"""IoT ingestion: a fleet of devices, each sending a reading every few seconds, through one
producer with bounded memory, and no reading lost without the program knowing.

The pattern:

- the device id is the partition key, so each device's readings stay in order on one shard;
- ``submit`` returns as soon as a reading is admitted, so one task can feed many devices; when
  ``max_outstanding_records`` readings are in flight it waits, and the devices fall behind
  instead of the process running out of memory;
- the handles go to a second task that awaits them; a reading that failed for good (past
  ``record_ttl``, or an error a retry cannot fix) goes to a dead-letter file to be replayed;
- ``producer.statistics()`` every few seconds: outstanding readings, errors by code.

Run it (it starts the emulator unless given ``--endpoint``)::

    python examples/iot_ingestion.py --devices 2000 --interval 2 --duration 20
    python examples/iot_ingestion.py --endpoint aws --region eu-west-1 --stream telemetry

At the end it reads the stream back and checks that every acknowledged reading is there.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from anykpl import PendingRecord, Producer, ProducerConfig, errors

GROUP_SIZE = 100  # devices fed by one task


def reading(run_id: str, device: str, seq: int, rng: random.Random) -> bytes:
    return json.dumps(
        {
            "run": run_id,
            "device": device,
            "seq": seq,
            "ts": round(time.time(), 3),
            "temp": round(rng.gauss(21.0, 2.0), 2),
            "hum": round(rng.uniform(30, 60), 1),
        },
        separators=(",", ":"),
    ).encode()


async def feed_group(
    producer: Producer,
    stream: str,
    devices: list[str],
    interval: float,
    until: float,
    run_id: str,
    handles: ObjectSendStream[PendingRecord],
    rng: random.Random,
) -> None:
    """Every ``interval`` seconds, one reading per device, spread evenly over the interval."""
    seq = 0
    start = anyio.current_time() + rng.uniform(0, interval)
    async with handles:
        while True:
            for index, device in enumerate(devices):
                due = start + seq * interval + index * interval / len(devices)
                if due > until:
                    return
                await anyio.sleep_until(due)
                data = reading(run_id, device, seq, rng)
                # waits here when the producer is full (backpressure)
                handle = await producer.submit(stream, data, partition_key=device)
                await handles.send(handle)
            seq += 1


async def await_results(
    receive: ObjectReceiveStream[PendingRecord],
    acknowledged: list[tuple[str, bytes]],
    failed: list[tuple[str, bytes]],
    dead_letters: Path,
) -> None:
    async with receive:
        async for handle in receive:
            try:
                await handle
            except errors.RecordFailedError as error:
                failed.append((handle.partition_key, handle.data))
                entry = {
                    "partition_key": handle.partition_key,
                    "data": handle.data.decode(),
                    "error_code": error.error_code,
                }
                # a real service would write these somewhere durable, and replay them
                with dead_letters.open("a", encoding="utf-8") as dead:
                    dead.write(json.dumps(entry) + "\n")
            else:
                acknowledged.append((handle.partition_key, handle.data))


async def report(producer: Producer, every: float) -> None:
    while True:
        await anyio.sleep(every)
        stats = producer.statistics()
        print(
            f"outstanding {stats.outstanding_records} readings "
            f"({stats.outstanding_bytes / 1024:.0f} KiB), errors by code {stats.errors_by_code}"
        )


async def run(target: Any, args: argparse.Namespace) -> bool:
    from _support import check_stream, new_run_id

    run_id = new_run_id()
    rng = random.Random(args.seed)
    config = ProducerConfig(
        **target.producer_options,
        max_outstanding_records=args.max_outstanding,  # the memory bound
        rate_limit=args.rate_limit,  # % of each shard's limits for this producer
        record_ttl=60.0,  # a reading older than a minute goes to the dead letters
    )
    devices = [f"dev-{n:05d}" for n in range(args.devices)]
    acknowledged: list[tuple[str, bytes]] = []
    failed: list[tuple[str, bytes]] = []
    dead_letters = Path(args.dead_letters)
    started = time.perf_counter()
    async with Producer(config) as producer:
        send, receive = anyio.create_memory_object_stream[PendingRecord](math.inf)
        until = anyio.current_time() + args.duration
        async with anyio.create_task_group() as tg:
            tg.start_soon(await_results, receive, acknowledged, failed, dead_letters)
            reporter = anyio.CancelScope()

            async def report_until_done() -> None:
                with reporter:
                    await report(producer, 2.0)

            tg.start_soon(report_until_done)
            async with send, anyio.create_task_group() as feeders:
                for first in range(0, len(devices), GROUP_SIZE):
                    group = devices[first : first + GROUP_SIZE]
                    feeders.start_soon(
                        feed_group,
                        producer,
                        target.stream,
                        group,
                        args.interval,
                        until,
                        run_id,
                        send.clone(),
                        random.Random(rng.random()),
                    )
            reporter.cancel()
    elapsed = time.perf_counter() - started
    print(
        f"{len(devices)} devices, {elapsed:.1f} s: {len(acknowledged)} readings acknowledged, "
        f"{len(failed)} failed" + (f" (written to {dead_letters})" if failed else "")
    )
    return check_stream(target, run_id, acknowledged, failed)


def main() -> None:
    from _support import add_target_arguments, open_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser, stream="telemetry", shards=4)
    parser.add_argument("--devices", type=int, default=2000)
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between readings")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds to send")
    parser.add_argument("--max-outstanding", type=int, default=50_000)
    parser.add_argument("--rate-limit", type=float, default=100.0, help="%% of each shard")
    parser.add_argument("--dead-letters", default="dead-letters.jsonl")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    with open_target(args) as target:
        ok = anyio.run(run, target, args, backend=args.backend)
    print("PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
