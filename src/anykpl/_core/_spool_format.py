"""The durable spool's file format: what a segment file holds, and reading one back. Pure: the
files, their mappings and the syncer are the runtime's (``_runtime/_spool.py``).

File layout, little-endian throughout::

    file header (32 bytes): b"ANYKPLSP", version u32, generation u32, sequence u64,
                            CRC-32 of those 24 bytes u32, 4 zero
    entry: magic u16, version u8, 0 u8, generation u32, body length u32, CRC-32 u32, body
    body:  stream length u16, key length u16, hash key length u8, tenant length u16,
           stream, partition key, explicit hash key (decimal ASCII), tenant (UTF-8), data

The CRC covers the generation and the body. An entry whose generation differs from its
file's is stale (it was written before the segment was rewound: its record is terminal) and
ends the log. A run of zero bytes ends it too. Anything else that does not check is a torn or
corrupt entry: recovery counts it, looks for the next entry that checks (by its magic) and
goes on, so one bad entry never hides the records after it, and no record is ever replayed
with bytes that fail their checksum.
"""

from __future__ import annotations

import mmap
import struct
import zlib
from dataclasses import dataclass
from typing import Final

from ._limits import MAX_SEGMENT_BYTES, MAX_TENANT_LENGTH, MIN_SEGMENT_BYTES

__all__ = (
    "END_MARK",
    "ENTRY_HEADER",
    "ENTRY_HEADER_SIZE",
    "ENTRY_MAGIC",
    "ENTRY_OVERHEAD",
    "FILE_HEADER_SIZE",
    "FILE_MAGIC",
    "VERSION",
    "RecoveredEntry",
    "encode_prefix",
    "generation_seed",
    "pack_file_header",
    "parse_segment",
    "round_up",
    "segment_bytes_for",
)

FILE_MAGIC: Final = b"ANYKPLSP"


VERSION: Final = 1


_FILE_HEADER = struct.Struct("<8sIIQI4x")  # the last u32: CRC-32 of the 24 bytes before it


FILE_HEADER_SIZE: Final = _FILE_HEADER.size  # 32


ENTRY_MAGIC: Final = 0x5BA7


_ENTRY_MAGIC_BYTES: Final = struct.pack("<H", ENTRY_MAGIC)


ENTRY_HEADER = struct.Struct("<HBBIII")


ENTRY_HEADER_SIZE: Final = ENTRY_HEADER.size  # 16


_BODY_PREFIX = struct.Struct("<HHBH")


_GENERATION = struct.Struct("<I")


END_MARK: Final = bytes(ENTRY_HEADER_SIZE)


#: The most an entry adds to a record's size (data + UTF-8 partition key, which the record
#: already counts): the entry header, the body prefix, a stream ARN of 2048 bytes, a hash key
#: of 39 digits, a tenant of 256 characters of up to 4 bytes.
ENTRY_OVERHEAD: Final = ENTRY_HEADER_SIZE + _BODY_PREFIX.size + 2048 + 39 + 4 * MAX_TENANT_LENGTH


def segment_bytes_for(max_bytes: int) -> int:
    """The size of a new segment under a spool limit of ``max_bytes``."""
    size = max(MIN_SEGMENT_BYTES, min(MAX_SEGMENT_BYTES, max_bytes // 16))
    return size - size % mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class RecoveredEntry:
    """One record read back from a segment."""

    stream: str
    partition_key: str
    explicit_hash_key: str | None
    tenant: str | None
    data: bytes


def parse_segment(content: bytes) -> tuple[list[RecoveredEntry], int, int]:
    """The records of one segment file, the number of torn or corrupt entries skipped, and
    where the last entry that checks ends."""
    if len(content) < FILE_HEADER_SIZE:
        return [], 1 if content else 0, 0
    magic, version, generation, _sequence, header_crc = _FILE_HEADER.unpack_from(content, 0)
    if magic != FILE_MAGIC or version != VERSION or zlib.crc32(content[:24]) != header_crc:
        return [], 1, 0
    seed = generation_seed(generation)
    entries: list[RecoveredEntry] = []
    corrupt = 0
    in_bad_run = False
    pos = valid_end = FILE_HEADER_SIZE
    end = len(content)
    while pos + ENTRY_HEADER_SIZE <= end:
        entry_magic, entry_version, _zero, entry_generation, body, crc = ENTRY_HEADER.unpack_from(
            content, pos
        )
        if entry_magic == 0 and body == 0 and crc == 0:
            break  # never written: the end of the log
        start = pos + ENTRY_HEADER_SIZE
        checks = (
            entry_magic == ENTRY_MAGIC
            and entry_version == VERSION
            and _BODY_PREFIX.size <= body <= end - start
        )
        if checks:
            if entry_generation != generation:
                stale_seed = zlib.crc32(_GENERATION.pack(entry_generation))
                if zlib.crc32(content[start : start + body], stale_seed) == crc:
                    break  # written before the segment started over: the end of the log
                checks = False
            else:
                checks = zlib.crc32(content[start : start + body], seed) == crc
        entry = _decode_body(content, start, body) if checks else None
        if entry is None:
            # torn or corrupt: go on at the next entry that checks, if there is one (a run of
            # bad bytes between two good entries counts once)
            if not in_bad_run:
                corrupt += 1
                in_bad_run = True
            found = content.find(_ENTRY_MAGIC_BYTES, pos + 1)
            if found < 0:
                break
            pos = found
            continue
        entries.append(entry)
        in_bad_run = False
        pos = valid_end = start + body
    return entries, corrupt, valid_end


def pack_file_header(buffer: mmap.mmap | bytearray, generation: int, sequence: int) -> None:
    """Write a segment's file header at the start of ``buffer``."""
    head = struct.pack("<8sIIQ", FILE_MAGIC, VERSION, generation, sequence)
    _FILE_HEADER.pack_into(buffer, 0, FILE_MAGIC, VERSION, generation, sequence, zlib.crc32(head))


def _decode_body(content: bytes, start: int, body: int) -> RecoveredEntry | None:
    stream_len, key_len, ehk_len, tenant_len = _BODY_PREFIX.unpack_from(content, start)
    pos = start + _BODY_PREFIX.size
    data_start = pos + stream_len + key_len + ehk_len + tenant_len
    if data_start > start + body or not stream_len or not key_len:
        return None
    try:
        stream = content[pos : pos + stream_len].decode()
        pos += stream_len
        key = content[pos : pos + key_len].decode()
        pos += key_len
        ehk = content[pos : pos + ehk_len].decode("ascii") if ehk_len else None
        pos += ehk_len
        tenant = content[pos : pos + tenant_len].decode() if tenant_len else None
    except UnicodeDecodeError:
        return None
    return RecoveredEntry(stream, key, ehk, tenant, content[data_start : start + body])


def encode_prefix(
    stream: str, partition_key: str, explicit_hash_key: str | None, tenant: str | None
) -> bytes:
    s = stream.encode()
    k = partition_key.encode()
    e = b"" if explicit_hash_key is None else explicit_hash_key.encode("ascii")
    t = b"" if tenant is None else tenant.encode()
    return _BODY_PREFIX.pack(len(s), len(k), len(e), len(t)) + s + k + e + t


def round_up(size: int) -> int:
    page = mmap.PAGESIZE
    return (size + page - 1) // page * page


def generation_seed(generation: int) -> int:
    """Where every entry's CRC-32 starts in a segment of ``generation``."""
    return zlib.crc32(_GENERATION.pack(generation))
