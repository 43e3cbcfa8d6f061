"""A Flask app (no event loop) that writes readings to Kinesis through ``SyncProducer``.

``SyncProducer`` runs the async producer in an event loop of its own, in a background thread,
and offers blocking, thread-safe calls. One per process, created on first use (so that a
server that forks its workers after loading the app, such as ``gunicorn --preload``, creates
it in each worker), closed at exit. The same pattern fits Django: put ``get_producer`` in a
module of your project and call it from views.

Serve it (the stream must exist; the endpoint and region come from the environment)::

    KINESIS_STREAM=readings AWS_REGION=eu-west-1 flask --app examples/flask_sync.py run

Or run this file: it starts the emulator (or uses ``--endpoint``), posts ``--requests``
readings from ``--threads`` threads through Flask's test client, and reads the stream back.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flask import Flask, request

from anykpl import ProducerConfig, SyncProducer, errors

_producer: SyncProducer | None = None
_producer_lock = threading.Lock()
_settings: dict[str, Any] = {}  # ProducerConfig overrides, for the self-test
_stream: list[str] = []  # the stream, for the self-test


def get_producer() -> SyncProducer:
    """The process's producer, created on first use."""
    global _producer
    with _producer_lock:
        if _producer is None:
            options: dict[str, Any] = {
                "region": os.environ.get("AWS_REGION"),
                "endpoint_url": os.environ.get("ANYKPL_ENDPOINT_URL"),
                "admission_timeout": 1.0,  # answer 503 rather than queue requests
                **_settings,
            }
            # closed (and flushed, bounded by close_timeout) at interpreter exit
            _producer = SyncProducer(ProducerConfig(**options))
        return _producer


app = Flask(__name__)


@app.post("/readings")
def post_reading() -> tuple[dict[str, Any], int]:
    reading = request.get_json()
    data = request.get_data()  # store the reading as the client sent it
    stream = _stream[0] if _stream else os.environ["KINESIS_STREAM"]
    try:
        result = get_producer().put_record(
            stream, data, partition_key=str(reading["device"]), timeout=5.0
        )
    except errors.BackpressureTimeout:
        return {"error": "too busy, try again"}, 503  # nothing was enqueued
    except TimeoutError:
        # admitted, not yet stored: it is still in flight and will be delivered or fail
        return {"status": "accepted"}, 202
    except errors.RecordFailedError as error:
        return {"error": f"not stored: {error.error_code}"}, 502
    return {"shard_id": result.shard_id, "sequence_number": result.sequence_number}, 201


# --- Running this file: the app in process, against the emulator --------------------------


def drive(target: Any, requests: int, threads: int) -> bool:
    from _support import check_stream, new_run_id

    run_id = new_run_id()
    _settings.update(target.producer_options)
    _stream.append(target.stream)
    client = app.test_client()

    def post(seq: int) -> tuple[str, bytes, int]:
        device = f"dev-{seq % 20}"
        data = json.dumps({"run": run_id, "device": device, "seq": seq, "temp": 21.5}).encode()
        response = client.post("/readings", data=data, content_type="application/json")
        return device, data, response.status_code

    with ThreadPoolExecutor(threads) as pool:
        outcomes = list(pool.map(post, range(requests)))
    get_producer().close()
    acknowledged = [(key, data) for key, data, status in outcomes if status == 201]
    others = [(key, data) for key, data, status in outcomes if status != 201]
    print(f"{len(acknowledged)} readings stored, {len(others)} not")
    return not others and check_stream(target, run_id, acknowledged)


def main() -> None:
    from _support import add_target_arguments, open_target

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_arguments(parser, stream="readings", shards=2)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    with open_target(args) as target:
        ok = drive(target, args.requests, args.threads)
    print("PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
