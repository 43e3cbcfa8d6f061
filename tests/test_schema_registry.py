"""The Glue Schema Registry's wire format (``anykpl.schema_registry``): the header the registry's
serde library writes and reads (``AWSSchemaRegistryConstants``), zlib compression, and clear
errors for what is not in that format."""

from __future__ import annotations

import uuid
import zlib

import pytest

from anykpl.errors import AggregationFormatError
from anykpl.schema_registry import (
    GlueSchemaRegistry,
    Schema,
    SchemaRegistryError,
    decode,
    encode,
)

VERSION = uuid.UUID("b7b4a7f0-0b2c-4c4e-9a4e-0f5d1b1d2e3f")


def test_the_header_is_the_registrys() -> None:
    encoded = encode(VERSION, b"avro bytes")
    assert encoded[:18].hex() == "0300b7b4a7f00b2c4c4e9a4e0f5d1b1d2e3f"  # a literal vector
    # header version 3, compression 0 (none), the UUID's 16 bytes big-endian (Java's
    # UUID.getMostSignificantBits then getLeastSignificantBits), then the data
    assert encoded == b"\x03\x00" + VERSION.bytes + b"avro bytes"
    assert decode(encoded) == (VERSION, b"avro bytes")


def test_zlib_compression_is_byte_5() -> None:
    data = b"reading " * 100
    encoded = encode(VERSION, data, "zlib")
    assert encoded[:2] == b"\x03\x05"
    assert zlib.decompress(encoded[18:]) == data
    assert decode(encoded) == (VERSION, data)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"\x03\x00short", "shorter than the 18-byte header"),
        (b"\x02\x00" + VERSION.bytes, "first byte is not 3"),
        (b"\x03\x07" + VERSION.bytes, "unknown compression byte 7"),
        (b"\x03\x05" + VERSION.bytes + b"not zlib", "zlib data is corrupt"),
    ],
)
def test_what_is_not_a_registry_record_is_a_clear_error(data: bytes, words: str) -> None:
    with pytest.raises(AggregationFormatError, match=words):
        decode(data)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="data_format"):
        Schema("{}", "XML", "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="definition and its name"):
        Schema("", "AVRO", "x")
    with pytest.raises(ValueError, match="compression"):
        encode(VERSION, b"x", "gzip")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compression"):
        GlueSchemaRegistry(compression="snappy")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_registry_not_opened_says_so() -> None:
    registry = GlueSchemaRegistry()
    with pytest.raises(RuntimeError, match="not open"):
        await registry.encode(Schema("{}", "JSON", "x"), b"x")


class _FakeGlue:
    """The registry calls, answered from a script: each call pops its next answer (a dict, or
    an error code to raise as botocore's ClientError)."""

    def __init__(self, **script: list[object]) -> None:
        self.script = script
        self.called: list[str] = []

    def __getattr__(self, name: str) -> object:
        async def call(**arguments: object) -> object:
            from botocore.exceptions import ClientError

            self.called.append(name)
            answer = self.script[name].pop(0)
            if isinstance(answer, str):
                status = 500 if answer == "InternalServiceException" else 400
                raise ClientError(
                    {
                        "Error": {"Code": answer, "Message": f"{answer}!"},
                        "ResponseMetadata": {"HTTPStatusCode": status},
                    },
                    name,
                )
            return answer

        return call


def _registry(
    glue: _FakeGlue, monkeypatch: pytest.MonkeyPatch, **options: object
) -> GlueSchemaRegistry:
    import anykpl.schema_registry as module

    monkeypatch.setattr(module, "PENDING_POLL_INTERVAL", 0.0)
    monkeypatch.setattr(module, "CALL_BACKOFF", 0.0)
    registry = GlueSchemaRegistry(**options)  # type: ignore[arg-type]
    registry._client = glue
    return registry


SCHEMA = Schema('{"type": "string"}', "AVRO", "s")


@pytest.mark.anyio
async def test_a_pending_version_is_awaited_until_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    glue = _FakeGlue(
        get_schema_by_definition=[{"SchemaVersionId": str(VERSION), "Status": "PENDING"}],
        get_schema_version=[{"Status": "PENDING"}, {"Status": "AVAILABLE"}],
    )
    registry = _registry(glue, monkeypatch)
    assert await registry.schema_version_id(SCHEMA) == VERSION
    assert glue.called == ["get_schema_by_definition", "get_schema_version", "get_schema_version"]
    assert await registry.schema_version_id(SCHEMA) == VERSION  # cached: no more calls
    assert len(glue.called) == 3


@pytest.mark.anyio
@pytest.mark.parametrize("status", ["FAILURE", "DELETING"])
async def test_a_version_the_registry_turns_down_is_an_error_and_not_cached(
    status: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    glue = _FakeGlue(
        get_schema_by_definition=["EntityNotFoundException"],
        register_schema_version=[{"SchemaVersionId": str(VERSION), "Status": "PENDING"}],
        get_schema_version=[{"Status": status}],
    )
    registry = _registry(glue, monkeypatch, auto_registration=True)
    with pytest.raises(SchemaRegistryError, match=f"is {status}, not AVAILABLE"):
        await registry.encode(SCHEMA, b"x")
    assert registry._versions == {}


@pytest.mark.anyio
async def test_throttles_and_5xx_are_tried_again_and_a_race_to_create_is_joined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    glue = _FakeGlue(
        get_schema_by_definition=["ThrottlingException", "EntityNotFoundException"],
        register_schema_version=[
            "InternalServiceException",
            "EntityNotFoundException",
            {"SchemaVersionId": str(VERSION), "Status": "AVAILABLE"},
        ],
        # another producer created the schema between our two calls
        create_schema=["AlreadyExistsException"],
    )
    registry = _registry(glue, monkeypatch, auto_registration=True)
    assert await registry.schema_version_id(SCHEMA) == VERSION
    assert glue.called == [
        "get_schema_by_definition",
        "get_schema_by_definition",
        "register_schema_version",
        "register_schema_version",
        "create_schema",
        "register_schema_version",
    ]


@pytest.mark.anyio
async def test_a_call_that_keeps_failing_is_an_error_after_its_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    glue = _FakeGlue(get_schema_by_definition=["ThrottlingException"] * 4)
    registry = _registry(glue, monkeypatch)
    with pytest.raises(SchemaRegistryError, match="ThrottlingException"):
        await registry.encode(SCHEMA, b"x")
    assert len(glue.called) == 4
    denied = _FakeGlue(get_schema_by_definition=["AccessDeniedException"])
    with pytest.raises(SchemaRegistryError, match="AccessDeniedException"):
        await _registry(denied, monkeypatch).encode(SCHEMA, b"x")
    assert len(denied.called) == 1  # not retried
