"""Kinesis's CBOR protocol (``application/x-amz-cbor-1.1``): PutRecords bodies written here,
answers read with ``cbor2``.

The AWS SDK for Java has sent Kinesis CBOR by default since 2016: the same operations, targets
and field names as the JSON protocol, but the body is CBOR (RFC 8949) and a record's ``Data`` is
a byte string instead of base64 text, so a request is about a quarter smaller and needs no
base64. Only the encoding of a body and the reading of an answer differ from JSON: the request
goes to the same URL with the same ``X-Amz-Target``, signed the same way (SigV4 over the body's
bytes), with ``Content-Type: application/x-amz-cbor-1.1``. An error comes back as a CBOR map with
``__type`` (the error code, perhaps after a ``namespace#``) and ``message``.

A PutRecords body is a handful of definite-length maps, arrays and strings, so it is written
here from bytes (:func:`put_records_body_parts`), as the JSON body is; answers are read by
``cbor2`` (:func:`load`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

__all__ = (
    "CBOR_CONTENT_TYPE",
    "error_answer",
    "load",
    "put_records_body_parts",
)

#: The content type of Kinesis's CBOR protocol, requests and answers
CBOR_CONTENT_TYPE: Final = "application/x-amz-cbor-1.1"

_TEXT: Final = 3 << 5
_BYTES: Final = 2 << 5
_ARRAY: Final = 4 << 5
_MAP: Final = 5 << 5


def _head(major: int, length: int) -> bytes:
    """A CBOR item's head: its major type (shifted) and a length (or count)."""
    if length < 24:
        return bytes((major | length,))
    if length < 0x100:
        return bytes((major | 24, length))
    if length < 0x10000:
        return bytes((major | 25,)) + length.to_bytes(2, "big")
    if length < 0x100000000:
        return bytes((major | 26,)) + length.to_bytes(4, "big")
    return bytes((major | 27,)) + length.to_bytes(8, "big")


def _text(field: str, value: object) -> bytes:
    if type(value) is not str:
        raise TypeError(f"{field} must be a str, not {type(value).__name__}")
    encoded = value.encode()
    return _head(_TEXT, len(encoded)) + encoded


_DATA: Final = _text("", "Data")
_PARTITION_KEY: Final = _text("", "PartitionKey")
_EXPLICIT_HASH_KEY: Final = _text("", "ExplicitHashKey")
_RECORDS: Final = _text("", "Records")
_TWO_FIELDS: Final = _head(_MAP, 2)
_THREE_FIELDS: Final = _head(_MAP, 3)


def put_records_body_parts(parameters: Mapping[str, Any]) -> list[bytes]:
    """The CBOR body of a PutRecords request, in pieces to be joined or written into a buffer
    (as the JSON body's, ``_botocore.put_records_body_parts``): a map of the request's
    parameters (``StreamName`` or ``StreamARN``, text) and ``Records``, an array of maps with
    ``Data`` (a byte string), ``PartitionKey`` and, where given, ``ExplicitHashKey`` (text).

    :raises TypeError: a record whose ``Data`` is not bytes-like, or a parameter or key that is
        not a str.
    :raises KeyError: a record without ``Data`` or ``PartitionKey``.
    """
    others = [(k, v) for k, v in parameters.items() if k != "Records"]
    records = parameters["Records"]
    parts = [_head(_MAP, len(others) + 1)]
    append = parts.append
    for name, value in others:
        append(_text("parameter name", name))
        append(_text(name, value))
    append(_RECORDS)
    append(_head(_ARRAY, len(records)))
    for entry in records:
        data = entry["Data"]
        if type(data) is not bytes:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise TypeError(f"Data must be bytes-like, not {type(data).__name__}")
            data = bytes(data)  # a memoryview's len() counts its items, not its bytes
        key = _text("PartitionKey", entry["PartitionKey"])
        hash_key = entry.get("ExplicitHashKey")
        append(_TWO_FIELDS if hash_key is None else _THREE_FIELDS)
        append(_DATA)
        append(_head(_BYTES, len(data)))
        append(data)
        append(_PARTITION_KEY)
        append(key)
        if hash_key is not None:
            append(_EXPLICIT_HASH_KEY)
            append(_text("ExplicitHashKey", hash_key))
    return parts


def load(content: bytes) -> Any:
    """A CBOR answer, decoded (``None`` if it is not CBOR)."""
    import cbor2

    try:
        return cbor2.loads(content)
    except (cbor2.CBORDecodeError, ValueError, TypeError, EOFError):
        return None


def error_answer(
    decoded: Any, status: int, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """An error answer as botocore's parser reads a JSON one: ``{"Error": {"Code": ...,
    "Message": ...}}``. The code is the ``x-amzn-ErrorType`` header's, else the answer's
    ``__type`` (or ``code``), else the status; anything after a ``:`` and up to a ``#`` is
    dropped (``aws.protocoltests#ResourceNotFoundException:http://...`` is
    ``ResourceNotFoundException``)."""
    if not isinstance(decoded, dict):
        decoded = {}
    error_type = ""
    for name, value in (headers or {}).items():
        if str(name).lower() == "x-amzn-errortype":
            error_type = str(value)
    code = error_type or str(decoded.get("__type") or decoded.get("code") or "")
    code = code.split(":", 1)[0].rpartition("#")[2] or str(status)
    message = decoded.get("message", decoded.get("Message", ""))
    return {"Error": {"Code": code, "Message": str(message or "")}}
