"""The producer's KPL metrics as Prometheus metrics, served over HTTP.

Starts the emulator (moto's server with Kinesis limits) in its own process, creates a stream,
serves ``/metrics`` on http://127.0.0.1:9464 with ``prometheus_client`` and puts records for
``--seconds`` seconds; scrape it meanwhile (``curl -s localhost:9464/metrics | grep kpl_``).
Needs the extras ``anykpl[prometheus,emulator]``.

    python examples/prometheus_metrics.py --seconds 30 --backend trio
"""

from __future__ import annotations

import argparse
import uuid

import anyio
import boto3
import prometheus_client

from anykpl import Producer
from anykpl.emulator import spawn
from anykpl.metrics import PrometheusSink

CREDENTIALS = {"aws_access_key_id": "demo", "aws_secret_access_key": "demo"}
REGION = "us-east-1"


async def produce(endpoint: str, stream: str, seconds: float, sink: PrometheusSink) -> None:
    async with Producer(
        region=REGION,
        endpoint_url=endpoint,
        metrics_sinks=[sink],
        metrics_upload_delay=1.0,  # the KPL's default is 60 s; scrapes want fresher values
        **CREDENTIALS,
    ) as producer:
        with anyio.move_on_after(seconds):
            device = 0
            while True:
                device = (device + 1) % 1000
                await producer.submit(stream, b"21.5C", partition_key=f"device-{device}")
        await producer.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--port", type=int, default=9464)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    args = parser.parse_args()

    registry = prometheus_client.CollectorRegistry()
    sink = PrometheusSink(registry)
    server, thread = prometheus_client.start_http_server(
        args.port, addr="127.0.0.1", registry=registry
    )
    print(f"metrics on http://127.0.0.1:{server.server_port}/metrics")
    try:
        with spawn() as endpoint:
            stream = f"metrics-{uuid.uuid4().hex[:8]}"
            kinesis = boto3.client(
                "kinesis", region_name=REGION, endpoint_url=endpoint, **CREDENTIALS
            )
            kinesis.create_stream(StreamName=stream, ShardCount=2)
            kinesis.get_waiter("stream_exists").wait(StreamName=stream)
            anyio.run(produce, endpoint, stream, args.seconds, sink, backend=args.backend)
        put = sum(
            registry.get_sample_value(
                "kpl_user_records_put_total",
                {"stream": stream, "shard": f"shardId-{i:012d}", "error_code": ""},
            )
            or 0.0
            for i in range(2)
        )
        print(f"kpl_user_records_put_total, summed over shards: {put:,.0f}")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


if __name__ == "__main__":
    main()
