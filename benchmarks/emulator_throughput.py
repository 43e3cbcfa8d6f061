"""How many MiB/s of PutRecords the emulator sustains on its one core.

The emulator runs in its own process (``anykpl.emulator.spawn``); this script sends prebuilt
PutRecords requests (500 records of ``--record-size`` bytes, spread evenly over the stream's
shards with explicit hash keys) over keep-alive connections from ``--connections`` threads for
``--duration`` seconds, then reads the emulator's own statistics. The request bodies are built
once, so the client's cost is writing bytes to a socket: what is measured is the emulator's
HTTP parsing, JSON decoding, routing, limiting and storing.

    python benchmarks/emulator_throughput.py                  # limits off
    python benchmarks/emulator_throughput.py --limits --shards 96

Bar (issue 3): at least 50 MiB/s, so the emulator is not the bottleneck of the benchmarks.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import threading
import time
import urllib.parse

from anykpl.emulator import EmulatorClient, Limits, spawn

MIB = 1024 * 1024


def request_body(stream: str, shards: int, record_size: int, offset: int) -> bytes:
    data = base64.b64encode(os.urandom(record_size)).decode()
    step = (1 << 128) // shards
    records = [
        {
            "Data": data,
            "PartitionKey": f"k{i}",
            "ExplicitHashKey": str(((i + offset) % shards) * step + step // 2),
        }
        for i in range(500)
    ]
    return json.dumps({"StreamName": stream, "Records": records}).encode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--shards", type=int, default=96)
    parser.add_argument("--record-size", type=int, default=10_000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--limits", action="store_true", help="enforce shard limits")
    args = parser.parse_args()

    limits = Limits() if args.limits else Limits.off()
    with spawn(streams={"bench": args.shards}, limits=limits) as url:
        address = urllib.parse.urlsplit(url)
        bodies = [request_body("bench", args.shards, args.record_size, i) for i in range(4)]
        client = EmulatorClient(url)
        client.reset_stats()
        stop = time.monotonic() + args.duration
        sent = [0] * args.connections

        def send(index: int) -> None:
            connection = http.client.HTTPConnection(address.hostname, address.port)
            headers = {
                "Content-Type": "application/x-amz-json-1.1",
                "X-Amz-Target": "Kinesis_20131202.PutRecords",
                "Authorization": "AWS4-HMAC-SHA256 Credential=bench/20261121/us-east-1/kinesis/"
                "aws4_request, SignedHeaders=host, Signature=0",
            }
            n = 0
            while time.monotonic() < stop:
                connection.request("POST", "/", body=bodies[n % len(bodies)], headers=headers)
                response = connection.getresponse()
                response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}")
                n += 1
            sent[index] = n
            connection.close()

        started = time.monotonic()
        threads = [threading.Thread(target=send, args=(i,)) for i in range(args.connections)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        totals = client.stats()["totals"]
    offered = sum(sent) * 500 * (args.record_size + 4)
    accepted = totals["accepted_bytes"]
    print(
        f"limits {'on' if args.limits else 'off'}, {args.shards} shards, "
        f"{args.record_size} B records, {args.connections} connections, {elapsed:.1f} s: "
        f"{sum(sent)} requests, offered {offered / MIB / elapsed:.1f} MiB/s, "
        f"accepted {accepted / MIB / elapsed:.1f} MiB/s "
        f"({totals['accepted_records'] / elapsed:,.0f} records/s), "
        f"throttled {totals['throttled_records']:,} records"
    )


if __name__ == "__main__":
    main()
