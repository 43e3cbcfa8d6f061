"""A FastAPI service that writes each request's readings to Kinesis and answers once they are
stored.

One ``Producer`` for the whole app, opened in the lifespan (so it is open before the first
request and flushed when the server stops). ``POST /readings`` waits for its one record;
``POST /readings/batch`` submits many and then waits for all of them. A full producer answers
503 after ``admission_timeout``, a record that failed for good answers 502 with its error code.

Serve it (the stream must exist; the endpoint and region come from the environment)::

    KINESIS_STREAM=my-stream AWS_REGION=eu-west-1 \\
        uvicorn fastapi_service:app --app-dir examples

    anykpl emulator --port 4567 --streams readings:2 &
    KINESIS_STREAM=readings ANYKPL_ENDPOINT_URL=http://127.0.0.1:4567 AWS_REGION=us-east-1 \\
        AWS_ACCESS_KEY_ID=x AWS_SECRET_ACCESS_KEY=x uvicorn fastapi_service:app --app-dir examples

Or run this file: it starts the emulator (or uses ``--endpoint``), sends ``--requests``
concurrent requests through the app in process, and reads the stream back to check that every
acknowledged reading is there. Needs ``pip install fastapi httpx``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, HTTPException, Request
from pydantic import BaseModel

from anykpl import Producer, ProducerConfig, errors


class Reading(BaseModel):
    device: str
    seq: int
    temperature: float
    run: str = ""


def producer_config(**overrides: Any) -> ProducerConfig:
    """The producer's settings, from the environment unless given."""
    options: dict[str, Any] = {
        "region": os.environ.get("AWS_REGION"),
        "endpoint_url": os.environ.get("ANYKPL_ENDPOINT_URL"),
        # a request should not wait long for room in a full producer: answer 503 instead
        "admission_timeout": 1.0,
        # give up on a record before the client gives up on the request
        "record_ttl": 20.0,
    }
    options.update(overrides)
    return ProducerConfig(**options)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    config: ProducerConfig = getattr(app.state, "producer_config", None) or producer_config()
    app.state.stream = getattr(app.state, "stream", None) or os.environ["KINESIS_STREAM"]
    async with Producer(config) as producer:  # leaving it flushes, bounded by close_timeout
        app.state.producer = producer
        yield


app = FastAPI(lifespan=lifespan)


def _encode(reading: Reading) -> tuple[bytes, str]:
    # the device is the partition key: one device's readings stay in order on one shard
    return reading.model_dump_json().encode(), reading.device


@app.post("/readings", status_code=201)
async def post_reading(reading: Reading, request: Request) -> dict[str, Any]:
    producer: Producer = request.app.state.producer
    data, key = _encode(reading)
    try:
        result = await producer.put_record(request.app.state.stream, data, partition_key=key)
    except errors.BackpressureTimeout:
        raise HTTPException(503, "too busy, try again", headers={"Retry-After": "1"}) from None
    except errors.RecordFailedError as error:
        raise HTTPException(502, f"not stored: {error.error_code}") from None
    return {"shard_id": result.shard_id, "sequence_number": result.sequence_number}


@app.post("/readings/batch", status_code=207)
async def post_readings(readings: list[Reading], request: Request) -> list[dict[str, Any]]:
    producer: Producer = request.app.state.producer
    stream = request.app.state.stream
    try:
        # admit them all first (they are batched together), then wait for each one
        pending = [
            await producer.submit(stream, data, partition_key=key)
            for data, key in map(_encode, readings)
        ]
    except errors.BackpressureTimeout:
        # the records admitted before the timeout are still delivered
        raise HTTPException(503, "too busy, try again", headers={"Retry-After": "1"}) from None
    answers: list[dict[str, Any]] = []
    for handle in pending:
        try:
            result = await handle
        except errors.RecordFailedError as error:
            answers.append({"status": 502, "error_code": error.error_code})
        else:
            answers.append({"status": 201, "sequence_number": result.sequence_number})
    return answers


def _identity(reading: Reading) -> tuple[str, bytes]:
    data, key = _encode(reading)
    return key, data


# --- Running this file: the app in process, against the emulator --------------------------


async def drive(target: Any, requests: int, batch: int) -> bool:
    import httpx
    from _support import check_stream, new_run_id

    run_id = new_run_id()
    app.state.producer_config = producer_config(**target.producer_options)
    app.state.stream = target.stream
    acknowledged: list[tuple[str, bytes]] = []
    failed: list[tuple[str, bytes]] = []

    async def one(client: httpx.AsyncClient, seq: int) -> None:
        reading = Reading(device=f"dev-{seq % 50}", seq=seq, temperature=20 + seq % 7, run=run_id)
        response = await client.post("/readings", json=reading.model_dump())
        (acknowledged if response.status_code == 201 else failed).append(_identity(reading))

    async def many(client: httpx.AsyncClient, first: int) -> None:
        readings = [
            Reading(device=f"dev-{seq % 50}", seq=seq, temperature=21.5, run=run_id)
            for seq in range(first, first + batch)
        ]
        response = await client.post("/readings/batch", json=[r.model_dump() for r in readings])
        response.raise_for_status()
        for reading, answer in zip(readings, response.json(), strict=True):
            ok = answer["status"] == 201
            (acknowledged if ok else failed).append(_identity(reading))

    transport = httpx.ASGITransport(app=app)
    # ASGITransport does not run the lifespan: enter it here, as a server would
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://app") as client,
        anyio.create_task_group() as tg,
    ):
        for seq in range(requests):
            tg.start_soon(one, client, seq)
        tg.start_soon(many, client, requests)
    print(f"{len(acknowledged)} readings acknowledged, {len(failed)} failed")
    return check_stream(target, run_id, acknowledged, failed) and not failed


def main() -> None:
    from _support import add_target_arguments, open_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser, stream="readings", shards=2)
    parser.add_argument("--requests", type=int, default=200, help="single-reading requests")
    parser.add_argument("--batch", type=int, default=300, help="readings in the batch request")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()
    with open_target(args) as target:
        ok = anyio.run(drive, target, args.requests, args.batch, backend=args.backend)
    print("PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
