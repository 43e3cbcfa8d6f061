"""Quickstart: put records through anykpl into a local Kinesis (moto's server), read them back.

Runs on a fresh machine with no AWS account: it starts moto's server on 127.0.0.1, creates a
stream, puts 10,000 records through the producer, and proves every one of them is in the
stream. Run with ``--backend trio`` for trio, and with ``--endpoint URL`` (or
``ANYKPL_ENDPOINT_URL``) to use a running ``anykpl emulator`` instead of starting one.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time
import uuid

import anyio
import boto3

from anykpl import Producer, ProducerConfig
from anykpl.aggregation import deaggregate
from anykpl.emulator import spawn

CREDENTIALS = {"aws_access_key_id": "demo", "aws_secret_access_key": "demo"}


def read_back(client: object, stream: str) -> collections.Counter[tuple[str, bytes]]:
    found: collections.Counter[tuple[str, bytes]] = collections.Counter()
    shards = client.list_shards(StreamName=stream)["Shards"]  # type: ignore[attr-defined]
    for shard in shards:
        iterator = client.get_shard_iterator(  # type: ignore[attr-defined]
            StreamName=stream, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while iterator:
            page = client.get_records(ShardIterator=iterator, Limit=10000)  # type: ignore[attr-defined]
            for record in page["Records"]:
                for user in deaggregate(record["Data"], record["PartitionKey"]):
                    found[(user.partition_key, user.data)] += 1
            if not page["Records"]:
                break
            iterator = page.get("NextShardIterator")
    return found


async def produce(endpoint: str, stream: str, count: int) -> collections.Counter[tuple[str, bytes]]:
    config = ProducerConfig(region="us-east-1", endpoint_url=endpoint, **CREDENTIALS)
    sent: collections.Counter[tuple[str, bytes]] = collections.Counter()
    started = time.perf_counter()
    async with Producer(config) as producer:
        pending = []
        for i in range(count):
            key = f"device-{i % 500}"
            data = f'{{"device": {i % 500}, "seq": {i}, "temp": {20 + i % 7}}}'.encode()
            pending.append(await producer.submit(stream, data, partition_key=key))
            sent[(key, data)] += 1
        await producer.flush()
        results = [p.result() for p in pending]
    elapsed = time.perf_counter() - started
    shards = collections.Counter(r.shard_id for r in results)
    print(f"put {len(results)} records in {elapsed:.2f} s ({len(results) / elapsed:,.0f}/s)")
    for shard, n in sorted(shards.items()):
        print(f"  {shard}: {n} records")
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--endpoint", default=os.environ.get("ANYKPL_ENDPOINT_URL"))
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        endpoint = args.endpoint or stack.enter_context(spawn())
        client = boto3.client(
            "kinesis", region_name="us-east-1", endpoint_url=endpoint, **CREDENTIALS
        )
        stream = f"quickstart-{uuid.uuid4().hex[:8]}"
        client.create_stream(StreamName=stream, ShardCount=4)
        sent = anyio.run(produce, endpoint, stream, args.records, backend=args.backend)
        found = read_back(client, stream)
        missing = sent - found
        duplicates = found - sent
        print(
            f"read back {sum(found.values())} records: {sum(missing.values())} missing, "
            f"{sum(duplicates.values())} extra"
        )
        if missing or duplicates:
            raise SystemExit(1)
        print("every record is in the stream.")


if __name__ == "__main__":
    main()
