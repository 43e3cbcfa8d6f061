"""A trio TCP service that ingests newline-delimited readings into Kinesis.

A client sends one reading per line, ``<device> <json>``, and gets one line back per reading,
in order: ``ok <shard> <sequence number>`` once the reading is stored, or ``error <code>``.
Each connection runs two tasks: one reads lines and submits them to the producer (it waits
when the producer is full, which pushes back on the client through TCP), the other awaits the
results in order and writes the answers. The producer is opened once, before the server
accepts connections, and flushed when the server stops.

Serve it on port 9000 until Ctrl-C or SIGTERM (the stream must exist)::

    python examples/trio_service.py --serve 9000 --endpoint aws --stream my-stream

Or run this file without ``--serve``: it starts the emulator (or uses ``--endpoint``), starts
the server on a free port, connects ``--clients`` clients that send ``--lines`` readings each,
checks every answer, and reads the stream back. Needs ``pip install 'anykpl[trio]'``.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
from functools import partial
from typing import Any

import trio

from anykpl import PendingRecord, Producer, ProducerConfig, errors

HOST = "127.0.0.1"


async def handle_connection(
    stream: trio.SocketStream, producer: Producer, kinesis_stream: str
) -> None:
    # unbounded: the producer's own admission limit (max_outstanding_records) is the bound
    send, receive = trio.open_memory_channel[PendingRecord | str](math.inf)

    async def read_lines() -> None:
        async with send:
            buffer = b""
            async for chunk in stream:
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    device, _, body = line.partition(b" ")
                    if not device or not body:
                        await send.send("error bad-line")
                        continue
                    try:
                        handle = await producer.submit(
                            kinesis_stream, body, partition_key=device.decode()
                        )
                    except (errors.InvalidRecordError, errors.RecordTypeError) as error:
                        await send.send(f"error {type(error).__name__}")
                    else:
                        await send.send(handle)

    async def write_answers() -> None:
        async with receive:
            async for item in receive:
                if isinstance(item, str):
                    answer = item
                else:
                    try:
                        result = await item
                    except errors.RecordFailedError as error:
                        answer = f"error {error.error_code}"
                    else:
                        answer = f"ok {result.shard_id} {result.sequence_number}"
                await stream.send_all(answer.encode() + b"\n")

    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(read_lines)
        nursery.start_soon(write_answers)


async def serve(
    port: int,
    config: ProducerConfig,
    kinesis_stream: str,
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``stop`` is set, then close the producer, which flushes."""
    async with Producer(config) as producer:

        async def handler(connection: trio.SocketStream) -> None:
            await handle_connection(connection, producer, kinesis_stream)

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(partial(trio.serve_tcp, handler, port, host=HOST))
            task_status.started(listeners)
            await stop.wait()
            nursery.cancel_scope.cancel()
        # Stopping the server cancelled the connections, not the producer: leaving the block
        # normally flushes what was admitted. (Leaving it by cancellation would skip the
        # flush and fail the outstanding records.)


async def serve_until_signalled(port: int, config: ProducerConfig, kinesis_stream: str) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, port, config, kinesis_stream, stop)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                print("stopping: flushing the producer")
                stop.set()
                break


# --- Running this file: the server and its clients, against the emulator ------------------


async def client(port: int, run_id: str, number: int, lines: int) -> list[tuple[str, bytes, str]]:
    """Send ``lines`` readings; return (device, body, answer) for each."""
    sent: list[tuple[str, bytes]] = []
    for seq in range(lines):
        device = f"dev-{number}-{seq % 10}"
        body = json.dumps({"run": run_id, "device": device, "seq": seq, "temp": 21.5})
        sent.append((device, body.encode()))
    answers: list[str] = []
    connection = await trio.open_tcp_stream(HOST, port)
    async with connection:
        await connection.send_all(b"".join(d.encode() + b" " + b + b"\n" for d, b in sent))
        buffer = b""
        while len(answers) < lines:
            chunk = await connection.receive_some()
            if not chunk:
                break
            buffer += chunk
            *done, buffer = buffer.split(b"\n")
            answers.extend(line.decode() for line in done)
    return [(device, body, answer) for (device, body), answer in zip(sent, answers, strict=False)]


async def drive(target: Any, clients: int, lines: int) -> bool:
    from _support import check_stream, new_run_id

    run_id = new_run_id()
    config = ProducerConfig(**target.producer_options)
    outcomes: list[tuple[str, bytes, str]] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(serve, 0, config, target.stream, stop)
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as clients_nursery:
            for number in range(clients):

                async def one(number: int = number) -> None:
                    outcomes.extend(await client(port, run_id, number, lines))

                clients_nursery.start_soon(one)
        stop.set()  # the server stops; the producer flushes and closes
    acknowledged = [(d, b) for d, b, answer in outcomes if answer.startswith("ok ")]
    failed = [(d, b) for d, b, answer in outcomes if not answer.startswith("ok ")]
    print(f"{len(outcomes)} answers: {len(acknowledged)} ok, {len(failed)} errors")
    complete = len(outcomes) == clients * lines
    return complete and not failed and check_stream(target, run_id, acknowledged, failed)


def main() -> None:
    from _support import add_target_arguments, open_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser, stream="ingest", shards=2)
    parser.add_argument("--serve", type=int, metavar="PORT", help="only serve, on this port")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--lines", type=int, default=250, help="readings per client")
    args = parser.parse_args()
    with open_target(args) as target:
        if args.serve is not None:
            config = ProducerConfig(**target.producer_options)
            trio.run(serve_until_signalled, args.serve, config, target.stream)
            return
        ok = trio.run(drive, target, args.clients, args.lines)
    print("PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
