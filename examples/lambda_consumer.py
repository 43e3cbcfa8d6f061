"""A Lambda consumer for anykpl records: deaggregate the trigger's event, report failures.

``handler`` is what you deploy (the function's handler: ``lambda_consumer.handler``). It
unpacks the KPL aggregates in a Kinesis trigger's event with ``anykpl.aggregation`` (no event
loop, no AWS client: only the pure decoder runs in the function), processes each reading, and
answers with a partial batch response: the sequence number of each Kinesis record whose user
records could not all be processed, so Lambda retries from there (with
``ReportBatchItemFailures`` turned on for the trigger).

Run as a script, it checks itself end to end against a local Kinesis: it puts readings through
the producer, reads the stream back with GetRecords, hands the handler the same events Lambda
would build (up to ``--batch`` Kinesis records per event, shard by shard), and proves every
reading reached the handler exactly once::

    python examples/lambda_consumer.py                  # starts the emulator itself
    python examples/lambda_consumer.py --endpoint URL   # a running emulator or moto server
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import json
import os
import uuid
from typing import Any

from anykpl.aggregation import deaggregate_lambda_event

#: what the handler did, for the self-check (a real function would write somewhere)
PROCESSED: collections.Counter[tuple[str, int]] = collections.Counter()


def process(reading: dict[str, Any]) -> None:
    """The work for one reading (here: count it)."""
    PROCESSED[(reading["device"], reading["seq"])] += 1


def handler(event: dict[str, Any], context: object = None) -> dict[str, Any]:
    """The Lambda handler for a Kinesis trigger with ``ReportBatchItemFailures``."""
    failed: list[str] = []
    for record in deaggregate_lambda_event(event):
        if record.sequence_number in failed:
            continue  # the whole Kinesis record is retried anyway
        try:
            process(json.loads(record.data))
        except (ValueError, KeyError):
            # a bad reading: retry its Kinesis record (all of its user records come again,
            # so processing must be idempotent; a real handler might park it instead)
            failed.append(record.sequence_number or "")
    return {"batchItemFailures": [{"itemIdentifier": sequence} for sequence in failed]}


# -- the self-check --------------------------------------------------------------------------


def lambda_events(client: Any, stream: str, batch: int) -> list[dict[str, Any]]:
    """The events Lambda would invoke the function with: each shard's Kinesis records, in
    order, ``batch`` at a time, shaped as a Kinesis trigger's event."""
    events: list[dict[str, Any]] = []
    for shard in client.list_shards(StreamName=stream)["Shards"]:
        shard_id = shard["ShardId"]
        iterator = client.get_shard_iterator(
            StreamName=stream, ShardId=shard_id, ShardIteratorType="TRIM_HORIZON"
        )["ShardIterator"]
        while iterator:
            page = client.get_records(ShardIterator=iterator, Limit=batch)
            if not page["Records"]:
                break
            events.append(
                {
                    "Records": [
                        {
                            "kinesis": {
                                "kinesisSchemaVersion": "1.0",
                                "partitionKey": record["PartitionKey"],
                                "sequenceNumber": record["SequenceNumber"],
                                "data": base64.b64encode(record["Data"]).decode("ascii"),
                                "approximateArrivalTimestamp": record[
                                    "ApproximateArrivalTimestamp"
                                ].timestamp(),
                            },
                            "eventSource": "aws:kinesis",
                            "eventVersion": "1.0",
                            "eventID": f"{shard_id}:{record['SequenceNumber']}",
                            "eventName": "aws:kinesis:record",
                            "awsRegion": "us-east-1",
                            "eventSourceARN": (
                                f"arn:aws:kinesis:us-east-1:123456789012:stream/{stream}"
                            ),
                        }
                        for record in page["Records"]
                    ]
                }
            )
            iterator = page.get("NextShardIterator")
    return events


async def produce(endpoint: str, stream: str, readings: int, devices: int) -> set[tuple[str, int]]:
    from anykpl import Producer

    sent: set[tuple[str, int]] = set()
    async with Producer(
        region="us-east-1",
        endpoint_url=endpoint,
        aws_access_key_id="demo",
        aws_secret_access_key="demo",
    ) as producer:
        pending = []
        for seq in range(readings):
            device = f"device-{seq % devices}"
            data = json.dumps({"device": device, "seq": seq, "temp": 20 + seq % 7}).encode()
            pending.append(await producer.submit(stream, data, partition_key=device))
            sent.add((device, seq))
        for handle in pending:
            await handle  # raises if a reading was not stored
    return sent


def main() -> None:
    import anyio
    import boto3

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", default=os.environ.get("ANYKPL_ENDPOINT_URL"))
    parser.add_argument("--stream", default=f"readings-{uuid.uuid4().hex[:8]}")
    parser.add_argument("--readings", type=int, default=5000)
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--batch", type=int, default=100, help="Kinesis records per event")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        endpoint = args.endpoint
        if endpoint is None:
            from anykpl.emulator import spawn

            endpoint = stack.enter_context(spawn())
        client = boto3.client(
            "kinesis",
            region_name="us-east-1",
            endpoint_url=endpoint,
            aws_access_key_id="demo",
            aws_secret_access_key="demo",
        )
        client.create_stream(StreamName=args.stream, ShardCount=2)
        client.get_waiter("stream_exists").wait(StreamName=args.stream)
        sent = anyio.run(produce, endpoint, args.stream, args.readings, args.devices)
        events = lambda_events(client, args.stream, args.batch)
    failures = [handler(event)["batchItemFailures"] for event in events]
    missing = sent - set(PROCESSED)
    twice = [key for key, count in PROCESSED.items() if count > 1]
    kinesis_records = sum(len(event["Records"]) for event in events)
    print(
        f"{len(sent):,} readings put; {kinesis_records:,} Kinesis records in {len(events)} "
        f"Lambda events; handled {sum(PROCESSED.values()):,}; missing: {len(missing)}, "
        f"twice: {len(twice)}, failed batch items: {sum(map(len, failures))}"
    )
    if missing or twice or any(failures) or PROCESSED.keys() - sent:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
