"""What every example shares: where to send (the emulator, another endpoint, or AWS) and how to
prove afterwards that every acknowledged record is in the stream.

Not part of anykpl; the examples import it from their own directory.

- no ``--endpoint`` (and no ``ANYKPL_ENDPOINT_URL``): start the emulator in its own process,
  with the service's per-shard limits, and create the stream there;
- ``--endpoint http://127.0.0.1:4567``: a running ``anykpl emulator`` (or any Kinesis-compatible
  endpoint); the stream is created if it does not exist; dummy credentials if none are set;
- ``--endpoint aws``: AWS itself, with botocore's usual credentials and region. The stream must
  exist (``aws kinesis create-stream --stream-name NAME --shard-count 1``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import boto3
import botocore.exceptions

from anykpl.readback import count_user_records, judge

DUMMY_CREDENTIALS = {"aws_access_key_id": "example", "aws_secret_access_key": "example"}


def add_target_arguments(parser: argparse.ArgumentParser, *, stream: str, shards: int) -> None:
    parser.add_argument(
        "--endpoint",
        default=os.environ.get("ANYKPL_ENDPOINT_URL"),
        help="Kinesis endpoint URL, or 'aws' (default: $ANYKPL_ENDPOINT_URL, else start the "
        "emulator)",
    )
    parser.add_argument("--region", default=None, help="AWS region (default: botocore's)")
    parser.add_argument("--stream", default=stream, help=f"stream name (default: {stream})")
    parser.add_argument(
        "--shards", type=int, default=shards, help="shards, when the stream is created"
    )


@dataclass(frozen=True)
class Target:
    """Where an example sends: keyword arguments for ``ProducerConfig`` and a boto3 client."""

    stream: str
    producer_options: dict[str, Any]
    client: Any  # a boto3 Kinesis client, for creating the stream and reading it back
    pace: float = 0.0  # seconds between GetRecords calls (AWS allows 5 per shard per second)


@contextlib.contextmanager
def open_target(args: argparse.Namespace) -> Iterator[Target]:
    """The stream to send to, per ``--endpoint`` (see the module docstring)."""
    if args.endpoint is None:
        from anykpl.emulator import spawn

        with spawn(streams={args.stream: args.shards}) as url:
            yield _target(args.stream, url, args.region or "us-east-1", local=True)
        return
    if args.endpoint == "aws":
        yield _target(args.stream, None, args.region, local=False)
        return
    target = _target(args.stream, args.endpoint, args.region or "us-east-1", local=True)
    _ensure_stream(target.client, args.stream, args.shards)
    yield target


def _target(stream: str, endpoint: str | None, region: str | None, *, local: bool) -> Target:
    options: dict[str, Any] = {"endpoint_url": endpoint, "region": region}
    if local and boto3.Session().get_credentials() is None:
        options.update(DUMMY_CREDENTIALS)
    client_options = {k: v for k, v in options.items() if k != "region"}
    client = boto3.client("kinesis", region_name=region, **client_options)
    return Target(stream, options, client, pace=0.0 if local else 0.2)


def _ensure_stream(client: Any, stream: str, shards: int) -> None:
    try:
        client.describe_stream_summary(StreamName=stream)
    except botocore.exceptions.ClientError as error:
        if error.response["Error"]["Code"] != "ResourceNotFoundException":
            raise
        client.create_stream(StreamName=stream, ShardCount=shards)
    client.get_waiter("stream_exists").wait(
        StreamName=stream, WaiterConfig={"Delay": 1, "MaxAttempts": 60}
    )


def new_run_id() -> str:
    """A tag put in every record of one run, so that the check ignores earlier runs' records."""
    return uuid.uuid4().hex[:8]


def check_stream(
    target: Target,
    run_id: str,
    acknowledged: Collection[tuple[str, bytes]],
    failed: Collection[tuple[str, bytes]] = (),
) -> bool:
    """Read the stream back and check that every acknowledged record of this run is in it.

    Records are identified by (partition key, data), so each record of a run must be distinct.
    Prints the verdict; returns whether it passed.
    """
    tag = run_id.encode()
    found, _ = count_user_records(
        target.client, target.stream, keep=lambda _, data: tag in data, pace=target.pace
    )
    verdict = judge(acknowledged, found, failed)
    print(
        f"read back: {verdict.present} of {verdict.acknowledged} acknowledged records present, "
        f"{verdict.missing} missing, {verdict.duplicates} duplicates, "
        f"{verdict.unexpected} unexpected, {verdict.failed} failed"
    )
    return verdict.ok
