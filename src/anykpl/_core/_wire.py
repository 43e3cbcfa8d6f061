"""The KPL aggregated-record format: an encoder for the producer and a strict decoder.

An aggregated Kinesis record packs many user records into one Kinesis record::

    [ F3 89 9A C2 ][ protobuf AggregatedRecord ][ MD5 of the protobuf bytes, 16 bytes ]

with the proto2 schema of the KPL's ``aws/kinesis/protobuf/messages.proto``::

    message AggregatedRecord {
      repeated string partition_key_table     = 1;
      repeated string explicit_hash_key_table = 2;
      repeated Record records                 = 3;
    }
    message Record {
      required uint64 partition_key_index     = 1;
      optional uint64 explicit_hash_key_index = 2;
      required bytes  data                    = 3;
      repeated Tag    tags                    = 4;
    }
    message Tag { required string key = 1; optional string value = 2; }

The encoder mirrors ``aws/kinesis/core/kinesis_record.{h,cc}`` (``KinesisRecord::after_add``,
``serialize`` and ``accurate_size``, with ``detail::KeySet`` for the key tables); the format
itself is specified in the KPL's ``aggregation-format.md``. The decoder mirrors the KCL's
``software/amazon/kinesis/retrieval/AggregatorUtil.java``. The protobuf is hand-rolled: the
schema is three tiny messages, and building them field by field is both faster than a generated
message class and free of a protobuf dependency. The output is byte-identical to what protobuf's
serializer emits for the KPL's message (tables first, then records; inside a record field 1,
field 2 when present, then field 3), which ``tests/test_wire.py`` checks against protobuf itself.

Where we differ from ``kinesis_record.cc``, and why:

* The builder only does the aggregated framing. Sending a lone user record raw, the outer
  partition key ``"a"`` and the outer explicit hash key (the first record's hash key) are the
  caller's business (``_aggregator.py``), so :attr:`AggregateBuilder.size` is the framed size even
  for one record, and 20 (not 0) when empty.
* There is one size and it is exact. The KPL keeps an ``estimated_size`` (3 bytes per entry plus
  2 per index, a few bytes off either way) for its flush trigger and computes ``accurate_size`` with
  ``ByteSize()`` at flush time; when that is too large the Reducer takes records back out with
  ``remove_last``. :meth:`AggregateBuilder.size_with` predicts the exact size before the add,
  so nothing is ever added that has to be removed again, and there is no ``remove_last``.
* Key tables are de-duplicated in first-seen order, as ``KeySet`` does, but without reference
  counts: those only serve ``remove_last``. The producer's records find their key's index
  through the key cache's :class:`KeyFacts` rather than a table per aggregate; a key that
  goes to three aggregates or more in turn (three streams, three tenants on one shard) is
  looked up by its text in the older ones, which may then hold it twice (once each way),
  which decodes the same.
* Tags are never written (the KPL does not write them either); the decoder validates them and
  drops them.

The decoder is strict where the KCL is lenient; see :func:`decode_aggregate` and
:func:`deaggregate`.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .._compat import gc_untracker, mypyc_attr
from ..errors import AggregationFormatError

if TYPE_CHECKING:
    from ._records import Record, ShardBacklog

__all__ = (
    "AGGREGATION_OVERHEAD",
    "MAGIC",
    "AggregateBuilder",
    "DecodedRecord",
    "KeyFacts",
    "deaggregate",
    "decode_aggregate",
    "encode_aggregate",
    "is_aggregated",
    "key_table_entry",
    "unpack",
)

#: The four bytes every aggregated record starts with (``KinesisRecord::kMagic``).
MAGIC: Final = b"\xf3\x89\x9a\xc2"
_DIGEST_SIZE: Final = 16
#: Bytes an aggregated record has beyond its protobuf: the magic and the MD5 (``kFixedOverhead``).
AGGREGATION_OVERHEAD: Final = len(MAGIC) + _DIGEST_SIZE

# Protobuf tags, (field number << 3) | wire type; wire type 0 is a varint, 2 is length-delimited.
_TAG_PARTITION_KEY_TABLE: Final = b"\x0a"  # AggregatedRecord.partition_key_table = 1, LEN
_TAG_EXPLICIT_HASH_KEY_TABLE: Final = b"\x12"  # AggregatedRecord.explicit_hash_key_table = 2, LEN
_TAG_RECORDS: Final = b"\x1a"  # AggregatedRecord.records = 3, LEN
_TAG_PARTITION_KEY_INDEX: Final = b"\x08"  # Record.partition_key_index = 1, VARINT
_TAG_EXPLICIT_HASH_KEY_INDEX: Final = b"\x10"  # Record.explicit_hash_key_index = 2, VARINT
_TAG_DATA: Final = b"\x1a"  # Record.data = 3, LEN

_UINT64_LIMIT: Final = 1 << 64


def _encode_varint(value: int) -> bytes:
    """The protobuf base-128 varint of a non-negative ``value``: 7 bits a byte, low bits first."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _varint_size(value: int) -> int:
    """The number of bytes :func:`_encode_varint` produces for ``value``."""
    return max(1, (value.bit_length() + 6) // 7)


def _prefixed_varints(tag: bytes, limit: int) -> tuple[bytes, ...]:
    """``tag + _encode_varint(n)`` for every ``n < limit <= 16384`` (one- and two-byte varints),
    built without calling _encode_varint 16384 times."""
    t = tag[0]
    return tuple(
        [bytes((t, n)) for n in range(min(limit, 0x80))]
        + [bytes((t, n & 0x7F | 0x80, n >> 7)) for n in range(0x80, limit)]
    )


# The hot path concatenates a tag with a varint for three fields of every record: the record's
# own length, its partition key index and its data length (and the EHK index when present). Those
# fields are looked up in tables: lengths up to 16383 (every two-byte varint, so every record of
# the small-record workloads aggregation is for) and indices up to 4095 (an aggregate with more
# distinct keys than that is one of tiny records under a raised AggregationMaxSize). Bigger values
# take the slow path, _record_header. With the key prefixes below, the tables hold about 1.3 MB
# and take about 4 ms to build at import.
_LENGTH_FIELD_LIMIT: Final = 1 << 14
_INDEX_FIELD_LIMIT: Final = 1 << 12
_RECORD_FIELD: Final = _prefixed_varints(_TAG_RECORDS, _LENGTH_FIELD_LIMIT)
_DATA_FIELD: Final = _RECORD_FIELD  # the same tag byte, 0x1a, in both messages
_PARTITION_KEY_INDEX_FIELD: Final = _prefixed_varints(_TAG_PARTITION_KEY_INDEX, _INDEX_FIELD_LIMIT)
_EXPLICIT_HASH_KEY_INDEX_FIELD: Final = _prefixed_varints(
    _TAG_EXPLICIT_HASH_KEY_INDEX, _INDEX_FIELD_LIMIT
)

# New key table entries are frequent too (an aggregate of a few hundred records over a thousand
# keys adds a new key with most records), so their tag + length prefixes are precomputed for keys
# up to 2047 bytes; a 256-character partition key is at most 1024 bytes of UTF-8.
_KEY_PREFIX_LIMIT: Final = 1 << 11
_PARTITION_KEY_ENTRY_PREFIX: Final = _prefixed_varints(_TAG_PARTITION_KEY_TABLE, _KEY_PREFIX_LIMIT)
_EXPLICIT_HASH_KEY_ENTRY_PREFIX: Final = _prefixed_varints(
    _TAG_EXPLICIT_HASH_KEY_TABLE, _KEY_PREFIX_LIMIT
)


# The header of a record without an explicit hash key depends on its partition key's index in
# the aggregate and its data length only, and both repeat (indices from 0 in every aggregate,
# and the same few lengths): each header is built once and shared. No allocation per record
# then, where a new header would live as long as its aggregate (the CHANGELOG's measurements).
# Found by index, then by length (``_header_rows[pk_index][data_len]``): a list item and a
# small int's lookup, where one key of both (``data_len << 32 | pk_index``) took two
# arithmetic operations on a two-digit int and its hash (125 ns a record in the pure build).
# Indices up to _HEADER_INDEX_LIMIT have a row; at most _HEADER_CACHE_LIMIT headers are kept.
_HEADER_INDEX_LIMIT: Final = 1 << 12
_HEADER_CACHE_LIMIT: Final = 1 << 14
_header_rows: Final[list[dict[int, bytes]]] = []
_header_count: Final = [0]  # the headers kept in _header_rows


def _record_header(pk_index: int, ehk_index: int | None, data_len: int) -> bytes:
    """Everything of one ``records`` entry but the data itself; the slow path of ``add``."""
    inner = _TAG_PARTITION_KEY_INDEX + _encode_varint(pk_index)
    if ehk_index is not None:
        inner += _TAG_EXPLICIT_HASH_KEY_INDEX + _encode_varint(ehk_index)
    inner += _TAG_DATA + _encode_varint(data_len)
    return _TAG_RECORDS + _encode_varint(len(inner) + data_len) + inner


def _plain_header(pk_index: int, data_len: int) -> bytes:
    """The header of a record without an explicit hash key (see ``_header_rows``)."""
    rows = _header_rows
    try:
        return rows[pk_index][data_len]
    except (IndexError, KeyError):
        pass
    try:
        tail = _PARTITION_KEY_INDEX_FIELD[pk_index] + _DATA_FIELD[data_len]
        found = _RECORD_FIELD[len(tail) + data_len] + tail
    except IndexError:
        found = _record_header(pk_index, None, data_len)
    if pk_index < _HEADER_INDEX_LIMIT:
        if _header_count[0] >= _HEADER_CACHE_LIMIT:
            rows.clear()
            _header_count[0] = 0
        while len(rows) <= pk_index:
            rows.append({})
        rows[pk_index][data_len] = found
        _header_count[0] += 1
    return found


def key_table_entry(encoded: bytes) -> bytes:
    """A partition key's entry in an aggregate's key table (tag, length, UTF-8 bytes)."""
    try:
        return _PARTITION_KEY_ENTRY_PREFIX[len(encoded)] + encoded
    except IndexError:
        return _TAG_PARTITION_KEY_TABLE + _encode_varint(len(encoded)) + encoded


#: Untracks a list (by its address) from the cyclic garbage collector: for the lists of bytes or
#: numbers the hot path makes by the hundred (an aggregate's parts, a column batch's columns and
#: positions), which no cycle can pass through, and which each young collection otherwise walks
#: element by element (a firehose's young collections walked 16,000 list elements each). ``None``
#: where there is no way to (see ``gc_untracker``).
untrack_list: Final = gc_untracker([])

#: Every AggregateBuilder's token: unique in the process and never reused (an object's id may
#: be), so that a KeyFacts naming a builder's token can only mean that builder.
_builder_tokens: Final = itertools.count(1)


@mypyc_attr(acyclic=True)
class KeyFacts:
    """One partition key as the producer's key cache remembers it: its text, hash key, UTF-8
    length, its entry in an aggregate's key table (and that entry's size), and the last two
    aggregates whose tables took it, with its index in each (their builders' tokens, which
    grow with each builder; 0: none).

    :meth:`AggregateBuilder.add_key_within` finds the key's index in its own table from these,
    with no dictionary lookup, and appends the entry, encoded once per key, when its table does
    not hold the key yet. Two, so that a key put to two streams (or for two tenants) in turn
    keeps one entry in each aggregate; with more in turn, the older aggregates look the key up
    by its text.

    Also where the key's records went last: the backlog of the shard its hash key falls in
    (``backlog``) under the shard map whose :attr:`~anykpl._core._shard_map.ShardMap.version`
    is ``placed`` (0: none), which admission takes instead of a search of the map while that
    map is the stream's (a new map, or another stream's, has another version). Acyclic
    (compiled build): numbers, strings, bytes and a backlog, which refers to no record.
    """

    __slots__ = (
        "backlog",
        "entry",
        "entry_size",
        "hash_key",
        "index",
        "key",
        "other_index",
        "other_table",
        "placed",
        "size",
        "table",
    )

    def __init__(self, key: str, hash_key: int, size: int, entry: bytes) -> None:
        self.key = key
        self.hash_key = hash_key
        self.size = size
        self.entry = entry
        self.entry_size = len(entry)
        self.table = 0
        self.index = 0
        self.other_table = 0
        self.other_index = 0
        self.placed = 0
        self.backlog: ShardBacklog | None = None


def _key_entry_size(key: str) -> int:
    """Bytes a new key table entry adds: tag, length varint, UTF-8 bytes."""
    n = len(key) if key.isascii() else len(key.encode("utf-8"))
    return 1 + (1 if n < 0x80 else _varint_size(n)) + n


class AggregateBuilder:
    """Incrementally builds one aggregated record. Hot path: :meth:`add` is called once per user
    record.

    Each record is stored as two parts, its protobuf header (tag, lengths and indices, built from
    the precomputed tables) and the caller's data object, so the data is copied once, in
    :meth:`serialize`. The exact protobuf length is kept as a running total.
    """

    __slots__ = (
        "_ehk_indices",
        "_ehk_table",
        "_parts",
        "_pk_indices",
        "_pk_table",
        "_size",
        "_token",
    )

    def __init__(self) -> None:
        # what KeyFacts name this builder by (add_key_within)
        self._token: int = next(_builder_tokens)
        self._pk_indices: dict[str, int] = {}
        self._ehk_indices: dict[str, int] = {}
        # Encoded table entries (tag + length + UTF-8), in first-seen order.
        self._pk_table: list[bytes] = []
        self._ehk_table: list[bytes] = []
        # Alternating record header and record data.
        self._parts: list[bytes] = []
        # Length of the protobuf AggregatedRecord.
        self._size = 0
        if untrack_list is not None:  # lists of bytes (see untrack_list)
            untrack_list(id(self._pk_table))
            untrack_list(id(self._ehk_table))
            untrack_list(id(self._parts))

    def size_with(self, partition_key: str, explicit_hash_key: str | None, data_len: int) -> int:
        """The exact serialized size, with the 20-byte overhead, that the aggregate would have
        after ``add(partition_key, explicit_hash_key, data)`` with ``len(data) == data_len``."""
        size = self._size + AGGREGATION_OVERHEAD
        pk_index = self._pk_indices.get(partition_key)
        if pk_index is None:
            pk_index = len(self._pk_table)
            size += _key_entry_size(partition_key)
        # Record: tag + index, [tag + index,] tag + length + data; then tag + length + Record.
        inner = (
            2
            + (1 if pk_index < 0x80 else 2 if pk_index < 0x4000 else _varint_size(pk_index))
            + (1 if data_len < 0x80 else 2 if data_len < 0x4000 else _varint_size(data_len))
            + data_len
        )
        if explicit_hash_key is not None:
            ehk_index = self._ehk_indices.get(explicit_hash_key)
            if ehk_index is None:
                ehk_index = len(self._ehk_table)
                size += _key_entry_size(explicit_hash_key)
            inner += 2 if ehk_index < 0x80 else 1 + _varint_size(ehk_index)
        size += 1 + inner
        return size + (1 if inner < 0x80 else 2 if inner < 0x4000 else _varint_size(inner))

    def add(self, partition_key: str, explicit_hash_key: str | None, data: bytes) -> int:
        """Add a user record and return its index in the aggregate (its sub-sequence number).

        ``explicit_hash_key`` is the decimal string the user gave, or ``None``; only records that
        gave one get an EHK index. Keys are encoded as UTF-8; validation is the caller's job (a
        key that cannot be encoded raises :class:`UnicodeEncodeError` and leaves the aggregate
        as it was).
        """
        self.add_within(partition_key, explicit_hash_key, data, math.inf)
        return (len(self._parts) >> 1) - 1

    def add_within(
        self, partition_key: str, explicit_hash_key: str | None, data: bytes, limit: float
    ) -> bool:
        """Add a user record if the serialized aggregate (with its 20-byte overhead) stays
        within ``limit`` bytes; return whether it was added. One pass: the encoding used for
        the size check is the one kept (the producer's aggregator calls this per record)."""
        pk_index = self._pk_indices.get(partition_key)
        pk_entry = None
        if pk_index is None:
            pk_entry = key_table_entry(partition_key.encode())
            pk_index = len(self._pk_table)
        data_len = len(data)
        ehk_entry = None
        if explicit_hash_key is None:
            header = _plain_header(pk_index, data_len)
        else:
            ehk_index = self._ehk_indices.get(explicit_hash_key)
            if ehk_index is None:
                encoded = explicit_hash_key.encode()
                try:
                    ehk_entry = _EXPLICIT_HASH_KEY_ENTRY_PREFIX[len(encoded)] + encoded
                except IndexError:
                    ehk_entry = (
                        _TAG_EXPLICIT_HASH_KEY_TABLE + _encode_varint(len(encoded)) + encoded
                    )
                ehk_index = len(self._ehk_table)
            try:
                tail = (
                    _PARTITION_KEY_INDEX_FIELD[pk_index]
                    + _EXPLICIT_HASH_KEY_INDEX_FIELD[ehk_index]
                    + _DATA_FIELD[data_len]
                )
                header = _RECORD_FIELD[len(tail) + data_len] + tail
            except IndexError:
                header = _record_header(pk_index, ehk_index, data_len)
        size = self._size + len(header) + data_len
        if pk_entry is not None:
            size += len(pk_entry)
        if ehk_entry is not None:
            size += len(ehk_entry)
        if size + AGGREGATION_OVERHEAD > limit:
            return False
        # commit: only now are new table entries registered
        if pk_entry is not None:
            self._pk_indices[partition_key] = pk_index
            self._pk_table.append(pk_entry)
        if ehk_entry is not None:
            assert explicit_hash_key is not None
            self._ehk_indices[explicit_hash_key] = len(self._ehk_table)
            self._ehk_table.append(ehk_entry)
        parts = self._parts
        parts.append(header)
        parts.append(data)
        self._size = size
        return True

    def add_key_within(self, key: KeyFacts, data: bytes, limit: float) -> bool:
        """:meth:`add_within` for a record with no explicit hash key whose partition key the
        producer's key cache knows as ``key``: its index in this aggregate's key table comes
        from ``key``, and a key new to the table is appended as ``key`` has it encoded.

        When two aggregates opened after this one hold the key (it goes to three aggregates or
        more in turn: three streams, three tenants of one shard), the key is looked up by its
        text (:meth:`add_within`) instead, so this table holds it at most twice, once from
        each way: a key added by :meth:`add_within` is not known to this method, nor the other
        way round, and a table may hold such a key twice, which decodes the same.
        """
        token = self._token
        if key.table == token:
            pk_index = key.index
            entry_size = 0
        elif key.other_table == token:
            pk_index = key.other_index
            entry_size = 0
        elif key.table > token and key.other_table > token:
            return self.add_within(key.key, None, data, limit)
        else:  # a key new to the table: its entry is added (0 bytes it never is)
            pk_index = len(self._pk_table)
            entry_size = key.entry_size
        data_len = len(data)
        # _plain_header's cache, inline (one call less per record)
        try:
            header = _header_rows[pk_index][data_len]
        except (IndexError, KeyError):
            header = _plain_header(pk_index, data_len)
        size = self._size + len(header) + data_len + entry_size
        if size + AGGREGATION_OVERHEAD > limit:
            return False
        if entry_size:
            self._pk_table.append(key.entry)
            key.other_table = key.table
            key.other_index = key.index
            key.table = token
            key.index = pk_index
        parts = self._parts
        parts.append(header)
        parts.append(data)
        self._size = size
        return True

    def add_keys_within(
        self, records: Sequence[Record], start: int, stop: int, limit: float
    ) -> int:
        """:meth:`add_key_within` for ``records[start:stop]`` in order (each without an
        explicit hash key, under the key cache's :class:`KeyFacts` in its ``key_facts``), for
        as long as the aggregate stays within ``limit``; return the position of the first
        record not added (``stop``: all were). One call for a run of records (the producer's
        batches): the builder's state is read once and written back at the end."""
        token = self._token
        table = self._pk_table
        parts = self._parts
        size = self._size
        limit -= AGGREGATION_OVERHEAD
        rows = _header_rows
        for position in range(start, stop):
            record = records[position]
            key = record.key_facts
            data = record.data
            assert key is not None
            if key.table == token:
                pk_index = key.index
                entry_size = 0
            elif key.other_table == token:
                pk_index = key.other_index
                entry_size = 0
            elif key.table > token and key.other_table > token:
                # the key went to two newer aggregates since: by its text (add_key_within)
                self._size = size
                if not self.add_within(key.key, None, data, limit + AGGREGATION_OVERHEAD):
                    return position
                size = self._size
                continue
            else:
                pk_index = len(table)
                entry_size = key.entry_size
            data_len = len(data)
            try:
                header = rows[pk_index][data_len]
            except (IndexError, KeyError):
                header = _plain_header(pk_index, data_len)
            grown = size + len(header) + data_len + entry_size
            if grown > limit:
                self._size = size
                return position
            if entry_size:
                table.append(key.entry)
                key.other_table = key.table
                key.other_index = key.index
                key.table = token
                key.index = pk_index
            parts.append(header)
            parts.append(data)
            size = grown
        self._size = size
        return stop

    def add_items_within(
        self,
        keys: Sequence[KeyFacts],
        datas: Sequence[bytes],
        positions: Sequence[int],
        start: int,
        stop: int,
        limit: float,
    ) -> int:
        """:meth:`add_keys_within` for a column batch's items: ``keys[p]`` and ``datas[p]`` for
        each ``p`` of ``positions[start:stop]`` in order, for as long as the aggregate stays
        within ``limit``; return the index in ``positions`` of the first item not added
        (``stop``: all were)."""
        token = self._token
        table = self._pk_table
        parts = self._parts
        size = self._size
        limit -= AGGREGATION_OVERHEAD
        rows = _header_rows
        for index in range(start, stop):
            position = positions[index]
            key = keys[position]
            data = datas[position]
            if key.table == token:
                pk_index = key.index
                entry_size = 0
            elif key.other_table == token:
                pk_index = key.other_index
                entry_size = 0
            elif key.table > token and key.other_table > token:
                # the key went to two newer aggregates since: by its text (add_key_within)
                self._size = size
                if not self.add_within(key.key, None, data, limit + AGGREGATION_OVERHEAD):
                    return index
                size = self._size
                continue
            else:
                pk_index = len(table)
                entry_size = key.entry_size
            data_len = len(data)
            try:
                header = rows[pk_index][data_len]
            except (IndexError, KeyError):
                header = _plain_header(pk_index, data_len)
            grown = size + len(header) + data_len + entry_size
            if grown > limit:
                self._size = size
                return index
            if entry_size:
                table.append(key.entry)
                key.other_table = key.table
                key.other_index = key.index
                key.table = token
                key.index = pk_index
            parts.append(header)
            parts.append(data)
            size = grown
        self._size = size
        return stop

    @property
    def size(self) -> int:
        """The exact serialized size now: 20 + the protobuf length; 20 when empty."""
        return self._size + AGGREGATION_OVERHEAD

    def __len__(self) -> int:
        """The number of user records added."""
        return len(self._parts) >> 1

    def serialize(self) -> bytes:
        """The aggregated record: magic + protobuf + MD5(protobuf). The builder is unchanged."""
        # the protobuf's three parts joined each on its own and hashed in turn, then joined
        # once with the rest (a fifth less time than one join of the lists, hashed, joined)
        keys = b"".join(self._pk_table)
        hashes = b"".join(self._ehk_table)
        records = b"".join(self._parts)
        digest = hashlib.md5(keys, usedforsecurity=False)
        if hashes:
            digest.update(hashes)
        digest.update(records)
        return b"".join((MAGIC, keys, hashes, records, digest.digest()))

    def __repr__(self) -> str:
        return f"<AggregateBuilder records={len(self)} size={self.size}>"


def encode_aggregate(records: Iterable[tuple[str, str | None, bytes]]) -> bytes:
    """The aggregated record holding ``(partition_key, explicit_hash_key, data)`` records."""
    builder = AggregateBuilder()
    add = builder.add
    for partition_key, explicit_hash_key, data in records:
        add(partition_key, explicit_hash_key, data)
    return builder.serialize()


@dataclass(frozen=True, slots=True)
class DecodedRecord:
    """One user record read back from a Kinesis record."""

    partition_key: str
    explicit_hash_key: str | None
    data: bytes


def is_aggregated(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is framed as an aggregated record: the magic prefix and room for the
    checksum. Cheap; the checksum itself is not checked."""
    return len(data) >= AGGREGATION_OVERHEAD and data[:4] == MAGIC


# The decoder. The KCL (AggregatorUtil.java) parses with protobuf-java and is lenient: a
# protobuf parse error makes it treat the whole record as plain data, and a bad table index is
# logged and ends deaggregation of that record, keeping the user records before it. Once the MD5
# over the protobuf matches, corruption can only come from a broken producer, so we raise
# AggregationFormatError for every defect instead of delivering a partial or wrong result.
# Like protobuf we accept fields in any order, a repeated non-repeated field (the last one wins),
# over-long varints, and unknown fields of wire types 0, 1, 2 and 5. Unlike protobuf we reject a
# known field with the wrong wire type (protobuf keeps it as an unknown field, which silently
# drops an EHK index), groups (wire types 3 and 4: deprecated, and never written by a KPL),
# strings that are not UTF-8 (proto2 does not check them) and missing required fields (Python's
# protobuf does not check them; Java's does). Tags are validated and then dropped.


def _fail(message: str, offset: int) -> AggregationFormatError:
    return AggregationFormatError(f"corrupt aggregated record: {message} at byte {offset}")


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it; strict about truncation and
    overflow."""
    start = pos
    value = 0
    shift = 0
    while pos < end:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >= _UINT64_LIMIT:
                raise _fail("varint exceeds 64 bits", start)
            return value, pos
        shift += 7
        if shift >= 70:
            raise _fail("varint longer than 10 bytes", start)
    raise _fail("truncated varint", start)


def _read_length(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """A length-delimited field's length and the position of its first byte."""
    length, body = _read_varint(buf, pos, end)
    if length > end - body:
        raise _fail(f"length {length} runs past the end of its message", pos)
    return length, body


def _skip_field(buf: bytes, tag_pos: int, wire_type: int, pos: int, end: int) -> int:
    """Skip the value of an unknown field; return the position after it."""
    if wire_type == 0:
        return _read_varint(buf, pos, end)[1]
    if wire_type == 2:
        length, pos = _read_length(buf, pos, end)
        return pos + length
    if wire_type == 1 or wire_type == 5:
        width = 8 if wire_type == 1 else 4
        if width > end - pos:
            raise _fail("truncated fixed-width field", tag_pos)
        return pos + width
    raise _fail(f"unsupported wire type {wire_type}", tag_pos)


def _read_tag(buf: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(field number, wire type, position after the tag)."""
    byte = buf[pos]
    if byte < 0x80:
        tag, after = byte, pos + 1
    else:
        tag, after = _read_varint(buf, pos, end)
        if tag >= 1 << 32:
            raise _fail("tag exceeds 32 bits", pos)
    if tag < 8:
        raise _fail("field number 0", pos)
    return tag >> 3, tag & 7, after


def _decode_key(buf: bytes, pos: int, length: int, field: str) -> str:
    """The UTF-8 string field ``field`` at ``buf[pos:pos + length]``."""
    try:
        return buf[pos : pos + length].decode("utf-8")
    except UnicodeDecodeError:
        raise _fail(f"{field} is not valid UTF-8", pos) from None


def _check_tag(buf: bytes, pos: int, end: int) -> None:
    """Validate one ``Tag`` message in ``buf[pos:end]``. No KPL or KCL writes or reads tags, so
    their contents are dropped, but a malformed one is as corrupt as any other field."""
    start = pos
    has_key = False
    while pos < end:
        field, wire_type, after = _read_tag(buf, pos, end)
        if field == 1 or field == 2:
            if wire_type != 2:
                name = "key" if field == 1 else "value"
                raise _fail(f"Tag.{name} has wire type {wire_type}, expected 2", pos)
            length, body = _read_length(buf, after, end)
            _decode_key(buf, body, length, "Tag.key" if field == 1 else "Tag.value")
            has_key = has_key or field == 1
            pos = body + length
        else:
            pos = _skip_field(buf, pos, wire_type, after, end)
    if not has_key:
        raise _fail("Tag is missing its required key", start)


def _decode_record(buf: bytes, pos: int, end: int) -> tuple[int, int, int | None, bytes]:
    """One ``Record`` message in ``buf[pos:end]``: (its offset, pk index, EHK index, data)."""
    start = pos
    pk_index: int | None = None
    ehk_index: int | None = None
    data: bytes | None = None
    while pos < end:
        field, wire_type, after = _read_tag(buf, pos, end)
        if field == 1 or field == 2:
            if wire_type != 0:
                name = "partition_key_index" if field == 1 else "explicit_hash_key_index"
                raise _fail(f"Record.{name} has wire type {wire_type}, expected 0", pos)
            value, pos = _read_varint(buf, after, end)
            if field == 1:
                pk_index = value
            else:
                ehk_index = value
        elif field == 3:
            if wire_type != 2:
                raise _fail(f"Record.data has wire type {wire_type}, expected 2", pos)
            length, pos = _read_length(buf, after, end)
            data = buf[pos : pos + length]
            pos += length
        elif field == 4:
            if wire_type != 2:
                raise _fail(f"Record.tags has wire type {wire_type}, expected 2", pos)
            length, pos = _read_length(buf, after, end)
            _check_tag(buf, pos, pos + length)
            pos += length
        else:
            pos = _skip_field(buf, pos, wire_type, after, end)
    if pk_index is None:
        raise _fail("Record is missing its required partition_key_index", start)
    if data is None:
        raise _fail("Record is missing its required data", start)
    return start, pk_index, ehk_index, data


def _decode_protobuf(buf: bytes, pos: int, end: int) -> list[DecodedRecord]:
    """The ``AggregatedRecord`` in ``buf[pos:end]``."""
    partition_keys: list[str] = []
    explicit_hash_keys: list[str] = []
    records: list[tuple[int, int, int | None, bytes]] = []
    while pos < end:
        field, wire_type, after = _read_tag(buf, pos, end)
        if field == 1 or field == 2 or field == 3:
            if wire_type != 2:
                name = ("partition_key_table", "explicit_hash_key_table", "records")[field - 1]
                raise _fail(f"AggregatedRecord.{name} has wire type {wire_type}, expected 2", pos)
            length, body = _read_length(buf, after, end)
            if field == 1:
                partition_keys.append(_decode_key(buf, body, length, "partition_key_table entry"))
            elif field == 2:
                explicit_hash_keys.append(
                    _decode_key(buf, body, length, "explicit_hash_key_table entry")
                )
            else:
                records.append(_decode_record(buf, body, body + length))
            pos = body + length
        else:
            pos = _skip_field(buf, pos, wire_type, after, end)
    # Tables may legally follow the records, so indices are resolved at the end.
    result: list[DecodedRecord] = []
    for offset, pk_index, ehk_index, data in records:
        if pk_index >= len(partition_keys):
            raise _fail(
                f"partition_key_index {pk_index} is out of range for a table of "
                f"{len(partition_keys)}",
                offset,
            )
        explicit_hash_key = None
        if ehk_index is not None:
            if ehk_index >= len(explicit_hash_keys):
                raise _fail(
                    f"explicit_hash_key_index {ehk_index} is out of range for a table of "
                    f"{len(explicit_hash_keys)}",
                    offset,
                )
            explicit_hash_key = explicit_hash_keys[ehk_index]
        result.append(DecodedRecord(partition_keys[pk_index], explicit_hash_key, data))
    return result


def _as_bytes(data: bytes | bytearray | memoryview) -> bytes:
    return data if type(data) is bytes else bytes(data)


def decode_aggregate(data: bytes | bytearray | memoryview) -> list[DecodedRecord]:
    """The user records of an aggregated record, in order (index = sub-sequence number).

    Strict: raises :class:`~anykpl.errors.AggregationFormatError`, and nothing else, when the
    magic is missing, the record is shorter than 20 bytes, the MD5 does not match, or the
    protobuf is corrupt (truncated or over-long varints, lengths past the end, wrong wire types,
    missing required fields, table indices out of range, keys that are not UTF-8). Bytes after a
    complete record are part of the checksummed region and so fail the MD5 check.
    """
    buf = _as_bytes(data)
    if len(buf) < AGGREGATION_OVERHEAD:
        raise AggregationFormatError(
            f"not an aggregated record: {len(buf)} bytes, fewer than the "
            f"{AGGREGATION_OVERHEAD} of magic and checksum"
        )
    if buf[:4] != MAGIC:
        raise AggregationFormatError(
            f"not an aggregated record: starts with {buf[:4].hex()}, not {MAGIC.hex()}"
        )
    end = len(buf) - _DIGEST_SIZE
    if hashlib.md5(memoryview(buf)[4:end]).digest() != buf[end:]:
        raise AggregationFormatError(
            "corrupt aggregated record: the MD5 of the protobuf does not match the last 16 bytes"
        )
    return _decode_protobuf(buf, 4, end)


def deaggregate(
    data: bytes | bytearray | memoryview, partition_key: str, explicit_hash_key: str | None = None
) -> list[DecodedRecord]:
    """The user records in a Kinesis record as a consumer sees them, like the KCL's
    ``AggregatorUtil.deaggregate``.

    When ``data`` has the magic, is longer than 20 bytes and its MD5 matches, it is decoded as an
    aggregate; otherwise it is one plain record with the Kinesis record's own keys. This is the
    KCL's fallback: it does not treat exactly 20 bytes (an aggregate of nothing) as aggregated
    either. Unlike the KCL, a corrupt protobuf behind a matching MD5 raises
    :class:`~anykpl.errors.AggregationFormatError` instead of passing the bytes on as data.
    """
    return unpack(data, partition_key, explicit_hash_key)[0]


def unpack(
    data: bytes | bytearray | memoryview, partition_key: str, explicit_hash_key: str | None = None
) -> tuple[list[DecodedRecord], bool]:
    """:func:`deaggregate`, and whether ``data`` was an aggregate."""
    buf = _as_bytes(data)
    end = len(buf) - _DIGEST_SIZE
    if (
        end > len(MAGIC)
        and buf[:4] == MAGIC
        and hashlib.md5(memoryview(buf)[4:end]).digest() == buf[end:]
    ):
        return _decode_protobuf(buf, 4, end), True
    return [DecodedRecord(partition_key, explicit_hash_key, buf)], False
