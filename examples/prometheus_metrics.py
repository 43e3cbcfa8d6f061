"""The producer's KPL metrics as Prometheus metrics, served over HTTP.

Serves ``/metrics`` with ``prometheus_client`` (on ``--port``; 0, the default, picks a free
one), puts distinct records for ``--seconds`` seconds, then scrapes its own endpoint the way
Prometheus would and checks that ``kpl_user_records_put_total`` there equals the records the
producer acknowledged, and that every acknowledged record is in the stream. Scrape it
meanwhile with ``curl -s localhost:PORT/metrics | grep kpl_``. Needs the extras
``anykpl[prometheus,emulator]``.

    python examples/prometheus_metrics.py --seconds 30 --port 9464 --backend trio
    python examples/prometheus_metrics.py --endpoint http://127.0.0.1:4567
"""

from __future__ import annotations

import argparse
import sys
import urllib.request

import anyio
import prometheus_client
from _support import Target, add_target_arguments, check_stream, new_run_id, open_target
from prometheus_client.parser import text_string_to_metric_families

from anykpl import PendingRecord, Producer, errors
from anykpl.metrics import PrometheusSink


async def produce(
    target: Target, run_id: str, seconds: float, sink: PrometheusSink
) -> list[tuple[str, bytes]]:
    acknowledged: list[tuple[str, bytes]] = []
    pending: list[tuple[str, bytes, PendingRecord]] = []
    async with Producer(
        metrics_sinks=[sink],
        metrics_upload_delay=1.0,  # the KPL's default is 60 s; scrapes want fresher values
        **target.producer_options,
    ) as producer:
        with anyio.move_on_after(seconds):
            n = 0
            while True:
                key = f"device-{n % 1000}"
                data = f"{run_id} {n} 21.5C".encode()
                pending.append((key, data, await producer.submit(target.stream, data, key)))
                n += 1
        await producer.flush()
        for key, data, handle in pending:
            try:
                await handle
            except errors.RecordFailedError:
                continue
            acknowledged.append((key, data))
    # leaving the block sent the final metrics upload to the sink
    return acknowledged


def scraped_total(port: int, stream: str) -> float:
    """``kpl_user_records_put_total`` for ``stream``, summed over its shards, as scraped."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "kpl_user_records_put_total"
                and sample.labels.get("stream") == stream
            ):
                total += sample.value
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--port", type=int, default=0, help="metrics port (0: a free one)")
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    add_target_arguments(parser, stream="metrics-demo", shards=2)
    args = parser.parse_args()

    registry = prometheus_client.CollectorRegistry()
    sink = PrometheusSink(registry)
    server, thread = prometheus_client.start_http_server(
        args.port, addr="127.0.0.1", registry=registry
    )
    port = server.server_port
    print(f"metrics on http://127.0.0.1:{port}/metrics")
    try:
        with open_target(args) as target:
            run_id = new_run_id()
            acknowledged = anyio.run(
                produce, target, run_id, args.seconds, sink, backend=args.backend
            )
            put = scraped_total(port, target.stream)
            print(
                f"acknowledged {len(acknowledged):,}; scraped kpl_user_records_put_total {put:,.0f}"
            )
            in_stream = check_stream(target, run_id, acknowledged)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    return 0 if in_stream and put == len(acknowledged) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
