"""The Glue Schema Registry against moto's server, on both backends: schema versions looked up
once, registered with ``auto_registration``, records encoded in the registry's wire format,
put through the producer and read back from the stream with their schema version."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from anykpl import Producer, ProducerConfig
from anykpl.aggregation import deaggregate_records
from anykpl.schema_registry import GlueSchemaRegistry, Schema, SchemaRegistryError, decode

from .conftest import CREDENTIALS, REGION
from .test_end_to_end import read_stream

pytestmark = pytest.mark.anyio


def _avro(fields: list[str]) -> str:
    return json.dumps(
        {
            "type": "record",
            "name": "Reading",
            "fields": [{"name": name, "type": "double"} for name in fields],
        }
    )


@pytest.mark.parametrize("compression", ["none", "zlib"])
async def test_records_carry_their_schema_version_through_the_stream(
    compression: str, moto_endpoint: str, make_stream: Any, kinesis_client: Any
) -> None:
    import boto3

    stream = make_stream(1)
    config = ProducerConfig(region=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)
    name = f"reading-{uuid.uuid4().hex[:8]}"
    first = Schema(_avro(["temperature"]), "AVRO", name)
    second = Schema(_avro(["temperature", "humidity"]), "AVRO", name)
    payloads = [f"payload {i}".encode() * 20 for i in range(10)]
    registry = GlueSchemaRegistry(
        config,
        endpoint_url=moto_endpoint,
        auto_registration=True,
        compression=compression,  # type: ignore[arg-type]
    )
    async with Producer(config) as producer, registry:
        for i, payload in enumerate(payloads):
            schema = first if i < 5 else second
            data = await registry.encode(schema, payload)
            result = await producer.put_record(stream, data, partition_key=f"device-{i}")
            assert result.success
        versions = {schema: await registry.schema_version_id(schema) for schema in (first, second)}
    # the first: GetSchemaByDefinition, RegisterSchemaVersion (no schema), CreateSchema; the
    # second: GetSchemaByDefinition, RegisterSchemaVersion; then nothing more
    assert registry.calls == 5
    assert versions[first] != versions[second]

    glue = boto3.client("glue", region_name=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)
    for schema, version in versions.items():
        registered = glue.get_schema_version(SchemaVersionId=str(version))
        assert registered["SchemaDefinition"] == schema.definition
        assert registered["DataFormat"] == "AVRO"

    contents = read_stream(kinesis_client, stream)
    read = [
        decode(record.data)
        for records in contents.kinesis_records.values()
        for record in deaggregate_records(records)
    ]
    assert sorted(payload for _, payload in read) == sorted(payloads)
    expected = {payload: versions[first if i < 5 else second] for i, payload in enumerate(payloads)}
    assert all(version == expected[payload] for version, payload in read)


async def test_an_unregistered_schema_is_a_clear_error_without_auto_registration(
    moto_endpoint: str,
) -> None:
    config = ProducerConfig(region=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)
    schema = Schema(_avro(["pressure"]), "AVRO", f"nowhere-{uuid.uuid4().hex[:8]}")
    async with GlueSchemaRegistry(config, endpoint_url=moto_endpoint) as registry:
        with pytest.raises(SchemaRegistryError, match="auto_registration is off"):
            await registry.encode(schema, b"x")
        # registered by someone else (its owner, infrastructure as code): then found
        import boto3

        glue = boto3.client("glue", region_name=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)
        created = glue.create_schema(
            RegistryId={"RegistryName": "default-registry"},
            SchemaName=schema.name,
            DataFormat="AVRO",
            Compatibility="BACKWARD",
            SchemaDefinition=schema.definition,
        )
        version, data = decode(await registry.encode(schema, b"x"))
    assert str(version) == created["SchemaVersionId"]
    assert data == b"x"


async def test_a_registry_that_is_not_there_is_a_clear_error(moto_endpoint: str) -> None:
    config = ProducerConfig(region=REGION, endpoint_url=moto_endpoint, **CREDENTIALS)
    schema = Schema(_avro(["pressure"]), "AVRO", "reading")
    registry = GlueSchemaRegistry(
        config, endpoint_url=moto_endpoint, registry_name="missing", auto_registration=True
    )
    async with registry:
        with pytest.raises(SchemaRegistryError):
            await registry.encode(schema, b"x")
