"""``anykpl fleet-table create``: make the DynamoDB table a fleet coordinates through.

A fleet keeps its reports, lease and grants in S3 (``FleetConfig(bucket=...)``) or in one
DynamoDB table (``FleetConfig(table=...)``). This makes the table with the schema the
producers expect — partition key ``pk`` and sort key ``sk`` (strings), on-demand capacity —
and turns its time to live on (attribute ``expires``), so that leftovers of crashed members go
away on their own. A table that exists already with that schema is left as it is (exit 0); one
with another schema is an error (exit 1). Several fleets can share a table (each its own
``prefix``). See docs/fleet.md ("The DynamoDB table").
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio

from .._fleet._dynamodb_store import TTL_ATTRIBUTE, create_table
from .._transport._aws import create_client
from ..config import ProducerConfig
from ..errors import ConfigError

__all__ = ("add_arguments", "run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("create",), help="what to do: create the table")
    parser.add_argument("--table", required=True, help="the table's name")
    parser.add_argument("--region", help="the AWS region (default: botocore's chain)")
    parser.add_argument("--endpoint-url", help="DynamoDB's endpoint, such as the emulator's URL")


def run(args: argparse.Namespace) -> int:
    try:
        config = ProducerConfig(region=args.region)
    except ConfigError as exc:
        print(f"anykpl fleet-table: {exc}", file=sys.stderr)
        return 2
    outcome: str = anyio.run(_create, config, args.table, args.endpoint_url)
    print(f"anykpl fleet-table: {outcome}")
    return 1 if outcome.startswith("error") else 0


async def _create(config: ProducerConfig, table: str, endpoint_url: str | None) -> str:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        async with create_client(
            config, "dynamodb", max_pool_connections=1, endpoint_url=endpoint_url
        ) as client:
            try:
                ttl = await create_table(client, table)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "ResourceInUseException":
                    raise
                return await _existing(client, table)
    except (BotoCoreError, ClientError) as exc:
        return f"error: {exc}"
    if not ttl:
        return (
            f"created the table {table} (pk, sk; on demand); this endpoint has no time to "
            "live: leftover items are deleted by the allocator only"
        )
    return f"created the table {table} (pk, sk; on demand; time to live on 'expires')"


async def _existing(client: Any, table: str) -> str:
    """A table of that name exists: check its keys and their types, and turn its time to
    live on if a first run stopped before it did."""
    from botocore.exceptions import ClientError

    described = (await client.describe_table(TableName=table))["Table"]
    keys = {k["AttributeName"]: k["KeyType"] for k in described.get("KeySchema", [])}
    types = {
        a["AttributeName"]: a["AttributeType"] for a in described.get("AttributeDefinitions", [])
    }
    if keys != {"pk": "HASH", "sk": "RANGE"} or {types.get("pk"), types.get("sk")} != {"S"}:
        return (
            f"error: the table {table} exists with another schema (keys {keys}, types "
            f"{types}); the fleet needs pk (HASH) and sk (RANGE), both strings"
        )
    try:
        ttl = (await client.describe_time_to_live(TableName=table))["TimeToLiveDescription"]
    except ClientError as exc:
        if (exc.response.get("Error") or {}).get("Code") != "UnknownOperationException":
            raise
        return f"the table {table} exists already, with the fleet's schema (no time to live here)"
    if ttl.get("TimeToLiveStatus") in ("ENABLED", "ENABLING"):
        return f"the table {table} exists already, with the fleet's schema"
    try:
        await client.update_time_to_live(
            TableName=table,
            TimeToLiveSpecification={"Enabled": True, "AttributeName": TTL_ATTRIBUTE},
        )
    except ClientError as exc:
        if (exc.response.get("Error") or {}).get("Code") != "UnknownOperationException":
            raise
        return f"the table {table} exists already, with the fleet's schema (no time to live here)"
    return f"the table {table} exists already, with the fleet's schema; time to live turned on"
