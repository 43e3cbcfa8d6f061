"""The Glue Schema Registry's wire format (``anykpl.schema_registry``): the header the registry's
serde library writes and reads (``AWSSchemaRegistryConstants``), zlib compression, and clear
errors for what is not in that format."""

from __future__ import annotations

import uuid
import zlib

import pytest

from anykpl.errors import AggregationFormatError
from anykpl.schema_registry import GlueSchemaRegistry, Schema, decode, encode

VERSION = uuid.UUID("b7b4a7f0-0b2c-4c4e-9a4e-0f5d1b1d2e3f")


def test_the_header_is_the_registrys() -> None:
    encoded = encode(VERSION, b"avro bytes")
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
