"""Records in the AWS Glue Schema Registry's wire format, for producers and consumers.

The KPL's ``addUserRecord(stream, partitionKey, explicitHashKey, data, schema)`` hands the
record's serialized bytes (Avro, JSON or Protobuf) to the Glue Schema Registry serializer, which
prefixes the version of the schema they were written with. Consumers using the registry's
deserializer (the KCL's, Flink's, or :func:`decode` here) find the schema by that version.

The format (the registry's serde library, ``AWSSchemaRegistryConstants``)::

    [ 3 ][ 0 or 5 ][ the schema version's UUID, 16 bytes ][ the data, zlib-compressed if 5 ]
   header compression

With anykpl::

    registry = GlueSchemaRegistry(producer.config, registry_name="telemetry")
    async with registry:
        data = await registry.encode(Schema(avro_schema_json, "AVRO", "reading"), avro_bytes)
        await producer.put_record("readings", data, partition_key="device-7")

:meth:`GlueSchemaRegistry.encode` looks the schema version up once (``GetSchemaByDefinition``)
and caches it for the registry object's life; with ``auto_registration`` a schema or version
that is not there yet is created (``CreateSchema`` or ``RegisterSchemaVersion``), as the
serializer's ``schemaAutoRegistrationEnabled`` does. The client is the producer's kind (its
credentials, region, proxy, TLS and HTTP backend, or the region and endpoint given here), on
asyncio and trio. Nothing here runs unless you use it: records without a schema are sent as
they are.
"""

from __future__ import annotations

import random
import uuid
import zlib
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import anyio

from . import errors
from .config import ProducerConfig

__all__ = ("GlueSchemaRegistry", "Schema", "SchemaRegistryError", "decode", "encode")

#: the registry's wire format (``AWSSchemaRegistryConstants``)
HEADER_VERSION_BYTE = 3
COMPRESSION_NONE = 0
COMPRESSION_ZLIB = 5
HEADER_SIZE = 2 + 16

#: a version the registry has not approved yet (``PENDING``) is polled this often, this many
#: times, before it is given up on (the serde library waits 3 s, then polls 10 times)
PENDING_POLL_INTERVAL = 1.0
PENDING_POLLS = 10
#: a throttled, failed (5xx) or unreached registry call is tried this many times in all
CALL_ATTEMPTS = 4
CALL_BACKOFF = 0.2  # seconds before the second attempt, doubling, with jitter
_RETRIABLE = frozenset(
    {
        "ThrottlingException",
        "TooManyRequestsException",
        "InternalServiceException",
        "InternalFailure",
        "ServiceUnavailable",
        "ServiceUnavailableException",
    }
)

DataFormat = Literal["AVRO", "JSON", "PROTOBUF"]
Compression = Literal["none", "zlib"]


class SchemaRegistryError(errors.AnyKplError):
    """The registry did not give a schema version: the schema is not registered (and
    ``auto_registration`` is off), or a registry call failed. The message says which."""


@dataclass(frozen=True, slots=True)
class Schema:
    """A schema, as the KPL's ``Schema(schemaDefinition, dataFormat, schemaName)``.

    Attributes:
        definition: the schema's definition (Avro's JSON, a JSON Schema, a ``.proto`` text).
        data_format: ``"AVRO"``, ``"JSON"`` or ``"PROTOBUF"``.
        name: the schema's name in the registry.
    """

    definition: str
    data_format: DataFormat
    name: str

    def __post_init__(self) -> None:
        if self.data_format not in ("AVRO", "JSON", "PROTOBUF"):
            raise ValueError(
                f"data_format must be 'AVRO', 'JSON' or 'PROTOBUF', not {self.data_format!r}"
            )
        if not self.definition or not self.name:
            raise ValueError("a Schema needs its definition and its name")


def encode(schema_version_id: uuid.UUID, data: bytes, compression: Compression = "none") -> bytes:
    """``data`` in the registry's wire format, for the schema version ``schema_version_id``."""
    if compression == "zlib":
        return (
            bytes((HEADER_VERSION_BYTE, COMPRESSION_ZLIB))
            + schema_version_id.bytes
            + zlib.compress(data)
        )
    if compression != "none":
        raise ValueError(f"compression must be 'none' or 'zlib', not {compression!r}")
    return bytes((HEADER_VERSION_BYTE, COMPRESSION_NONE)) + schema_version_id.bytes + data


def decode(data: bytes | bytearray | memoryview) -> tuple[uuid.UUID, bytes]:
    """(the schema version's UUID, the data) of a record in the registry's wire format,
    decompressed.

    :raises ~anykpl.errors.AggregationFormatError: ``data`` is not in that format (it is not a
        registry record, or its compressed data is corrupt).
    """
    buf = bytes(data)
    if len(buf) < HEADER_SIZE or buf[0] != HEADER_VERSION_BYTE:
        raise errors.AggregationFormatError(
            "not a Glue Schema Registry record (its first byte is not 3, or it is shorter "
            f"than the {HEADER_SIZE}-byte header)"
        )
    version = uuid.UUID(bytes=buf[2:HEADER_SIZE])
    body = buf[HEADER_SIZE:]
    if buf[1] == COMPRESSION_NONE:
        return version, body
    if buf[1] == COMPRESSION_ZLIB:
        try:
            return version, zlib.decompress(body)
        except zlib.error as exc:
            raise errors.AggregationFormatError(
                f"a Glue Schema Registry record whose zlib data is corrupt: {exc}"
            ) from None
    raise errors.AggregationFormatError(
        f"a Glue Schema Registry record with an unknown compression byte {buf[1]}"
    )


class GlueSchemaRegistry:
    """Schema versions from the AWS Glue Schema Registry, looked up once and cached, and
    records encoded with them (see the module's docstring).

    Args:
        config: the producer's configuration: the Glue client takes its credentials, profile,
            region, proxy, TLS settings, timeouts and HTTP backend. Default: botocore's chain.
        registry_name: the registry (the serializer's ``registry.name``). Default
            ``"default-registry"``, as the serializer's.
        region: Glue's region, if not the producer's.
        endpoint_url: Glue's endpoint (such as moto's server), if not the region's.
        auto_registration: create a schema, or register a new version of it, when the
            definition is not in the registry yet. Default ``False``: a
            :class:`SchemaRegistryError` instead.
        compression: ``"none"`` (the default) or ``"zlib"``, as the serializer's
            ``compressionType``.
        compatibility: a schema created by ``auto_registration`` gets this compatibility mode.
            Default ``"BACKWARD"``, as the serializer's.
    """

    def __init__(
        self,
        config: ProducerConfig | None = None,
        *,
        registry_name: str = "default-registry",
        region: str | None = None,
        endpoint_url: str | None = None,
        auto_registration: bool = False,
        compression: Compression = "none",
        compatibility: str = "BACKWARD",
    ) -> None:
        if compression not in ("none", "zlib"):
            raise ValueError(f"compression must be 'none' or 'zlib', not {compression!r}")
        if not registry_name:
            raise ValueError("registry_name must not be empty")
        self.config = config if config is not None else ProducerConfig()
        self.registry_name = registry_name
        self.region = region
        self.endpoint_url = endpoint_url
        self.auto_registration = auto_registration
        self.compression: Compression = compression
        self.compatibility = compatibility
        #: registry calls made (a schema costs one, or two or three the first time it is
        #: registered; then none)
        self.calls = 0
        self._versions: dict[Schema, uuid.UUID] = {}
        self._lock = anyio.Lock()
        self._stack: AsyncExitStack | None = None
        self._client: Any = None

    def __repr__(self) -> str:
        return (
            f"<GlueSchemaRegistry {self.registry_name!r} schemas={len(self._versions)} "
            f"calls={self.calls}>"
        )

    async def __aenter__(self) -> GlueSchemaRegistry:
        from ._transport._aws import create_client

        if self._stack is not None:
            raise RuntimeError("the GlueSchemaRegistry is open already")
        stack = AsyncExitStack()
        self._client = await stack.enter_async_context(
            create_client(
                self.config,
                "glue",
                max_pool_connections=2,
                region=self.region,
                endpoint_url=self.endpoint_url,
            )
        )
        self._stack = stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def encode(self, schema: Schema, data: bytes | bytearray | memoryview) -> bytes:
        """``data`` (serialized with ``schema``) in the registry's wire format."""
        return encode(await self.schema_version_id(schema), bytes(data), self.compression)

    async def schema_version_id(self, schema: Schema) -> uuid.UUID:
        """The registry's version of ``schema``: cached, else looked up (and registered with
        ``auto_registration``).

        :raises SchemaRegistryError: it is not registered and ``auto_registration`` is off, or
            a registry call failed.
        :raises RuntimeError: the registry is not open (``async with registry:``).
        """
        found = self._versions.get(schema)
        if found is not None:
            return found
        async with self._lock:  # one lookup per schema, however many tasks ask at once
            found = self._versions.get(schema)
            if found is None:
                found = self._versions[schema] = await self._look_up(schema)
        return found

    async def _look_up(self, schema: Schema) -> uuid.UUID:
        client = self._client
        if client is None:
            raise RuntimeError("the GlueSchemaRegistry is not open: use 'async with registry:'")
        schema_id = {"RegistryName": self.registry_name, "SchemaName": schema.name}
        try:
            answer = await self._call(
                client.get_schema_by_definition,
                SchemaId=schema_id,
                SchemaDefinition=schema.definition,
            )
            return await self._available(schema, answer["SchemaVersionId"], answer.get("Status"))
        except _NotFound as missing:
            if not self.auto_registration:
                raise SchemaRegistryError(
                    f"schema {schema.name!r} in registry {self.registry_name!r} has no version "
                    "with this definition, and auto_registration is off "
                    f"({missing.message})"
                ) from None
        try:
            answer = await self._register(client, schema_id, schema)
        except _NotFound:  # no such schema yet: create it, with this definition
            try:
                answer = await self._call(
                    client.create_schema,
                    RegistryId={"RegistryName": self.registry_name},
                    SchemaName=schema.name,
                    DataFormat=schema.data_format,
                    Compatibility=self.compatibility,
                    SchemaDefinition=schema.definition,
                )
                answer = {**answer, "Status": answer.get("SchemaVersionStatus")}
            except _NotFound as missing:  # the registry itself (it is not created here)
                raise SchemaRegistryError(
                    f"schema {schema.name!r} could not be created in registry "
                    f"{self.registry_name!r}: {missing.message}"
                ) from None
            except _AlreadyExists:  # another producer created it meanwhile
                answer = await self._register(client, schema_id, schema)
        return await self._available(schema, answer["SchemaVersionId"], answer.get("Status"))

    async def _register(
        self, client: Any, schema_id: dict[str, str], schema: Schema
    ) -> dict[str, Any]:
        # the version of this definition, registered now or before (the registry answers the
        # existing version for a definition it has)
        return await self._call(
            client.register_schema_version, SchemaId=schema_id, SchemaDefinition=schema.definition
        )

    async def _available(self, schema: Schema, version_id: str, status: object) -> uuid.UUID:
        """``version_id`` once the registry has approved it (``AVAILABLE``): a ``PENDING``
        version is polled (``PENDING_POLLS`` times, ``PENDING_POLL_INTERVAL`` apart), as the
        registry's serde library does, since records must never carry a version the registry
        turns down (its compatibility check fails).

        :raises SchemaRegistryError: the version failed, is being deleted, or stays pending."""
        polls = 0
        while status == "PENDING" and polls < PENDING_POLLS:
            await anyio.sleep(PENDING_POLL_INTERVAL)
            polls += 1
            answer = await self._call(self._client.get_schema_version, SchemaVersionId=version_id)
            status = answer.get("Status")
        if status not in (None, "AVAILABLE"):  # (an answer without a status: taken as it is)
            raise SchemaRegistryError(
                f"version {version_id} of schema {schema.name!r} in registry "
                f"{self.registry_name!r} is {status}, not AVAILABLE"
                + (" (its compatibility check failed)" if status == "FAILURE" else "")
            )
        return uuid.UUID(version_id)

    async def _call(self, method: Callable[..., Any], **arguments: Any) -> dict[str, Any]:
        """One registry call, tried again after a throttle, a 5xx or a connection failure
        (``CALL_ATTEMPTS`` in all; the client makes one attempt per call)."""
        from botocore.exceptions import BotoCoreError, ClientError

        delay = CALL_BACKOFF
        attempt = 0
        while True:
            attempt += 1
            self.calls += 1
            try:
                answer: dict[str, Any] = await method(**arguments)
                return answer
            except ClientError as exc:
                error = exc.response.get("Error", {})
                code = error.get("Code", "")
                message = error.get("Message", str(exc))
                if code == "EntityNotFoundException":
                    raise _NotFound(message) from None
                if code == "AlreadyExistsException":
                    raise _AlreadyExists(message) from None
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if attempt == CALL_ATTEMPTS or not (code in _RETRIABLE or status >= 500):
                    raise SchemaRegistryError(
                        f"the Glue Schema Registry answered {code}: {message}"
                    ) from None
            except BotoCoreError as exc:
                if attempt == CALL_ATTEMPTS:
                    raise SchemaRegistryError(
                        f"the Glue Schema Registry was not reached: {exc}"
                    ) from None
            await anyio.sleep(delay * (0.5 + random.random()))
            delay *= 2


class _NotFound(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _AlreadyExists(Exception):
    pass
