"""The shard map: which open shard a hash key belongs to, kept fresh with ListShards.

Mirrors aws/kinesis/core/shard_map.{h,cc}:

- States INVALID → UPDATING → READY. While the map is not READY, :meth:`ShardMap.shard_id`
  returns ``None`` and the aggregator sends records unaggregated (as the KPL does).
- ListShards with ``ShardFilter={"Type": "AT_LATEST"}`` and ``MaxResults=1000``; later pages
  send **only** ``NextToken`` (sending it with a stream name is rejected: KPL #481/#482).
- On failure the refresh is retried after a backoff that starts at 1 s and grows ×1.5 to 30 s.
- :meth:`ShardMap.invalidate` refreshes only if the failing request *started* after the last
  refresh, the map is READY, and the predicted shard is absent or still open — the guard that
  stops a storm of refreshes caused by records predicted against a replaced shard. An
  invalidated map is INVALID at once: it predicts nothing until the refresh is in, so no
  record is sent to the stale ranges meanwhile (the refresh task may not run for a while).
- Hash ranges of shards are cached by shard id and kept for closed shards for 60 s after a
  refresh, so the Retrier can still judge where a record predicted for a parent landed.
- Prediction: the first open shard (sorted by ending hash key) whose ending key ≥ hash key,
  found by ``bisect``.

Where we differ: the KPL trusts ``AT_LATEST`` to return open shards only; some endpoints
(moto) ignore the filter, so shards with an ``EndingSequenceNumber`` are treated as closed here.
The map is a pure object (clock passed in); ``run_shard_map`` (``_shard_refresh``, not compiled)
is the thin async shell that performs the refreshes.
"""

from __future__ import annotations

import itertools
import logging
import math
from bisect import bisect_left
from collections.abc import Mapping
from enum import Enum
from typing import Any, Final

__all__ = ("CLOSED_SHARD_TTL", "ShardMap", "ShardMapState", "shard_number")

logger = logging.getLogger("anykpl.shard_map")

MIN_BACKOFF = 1.0
MAX_BACKOFF = 30.0
BACKOFF_GROWTH = 1.5
CLOSED_SHARD_TTL = 60.0


class ShardMapState(Enum):
    INVALID = "INVALID"
    UPDATING = "UPDATING"
    READY = "READY"


def shard_number(shard_id: str) -> int:
    """The number in ``shardId-000000000042`` (the KPL's ``shard_id_from_str``)."""
    try:
        return int(shard_id.rsplit("-", 1)[-1])
    except ValueError:
        return -1


#: :attr:`ShardMap.version`'s source, shared by every map of the process (0: no map's)
_versions: Final = itertools.count(1)


class ShardMap:
    """The open shards of one stream, sorted by ending hash key."""

    __slots__ = (
        "_ends",
        "_ids",
        "_new_ranges",
        "_open",
        "_pending_ends",
        "_ranges",
        "backoff",
        "ready",
        "refresh_requested",
        "state",
        "updated_at",
        "updates",
        "version",
    )

    def __init__(self) -> None:
        self.state = ShardMapState.INVALID
        # ``state is READY`` as a plain bool for the hot path: on Python 3.11 looking a member
        # up on an Enum class costs more than the bisect it guards (profiled: 15 % of a run)
        self.ready = False
        self._ends: list[int] = []
        self._ids: list[str] = []
        self._open: frozenset[str] = frozenset()
        self._ranges: dict[str, tuple[int, int]] = {}
        self._pending_ends: list[tuple[int, str]] = []
        self._new_ranges: dict[str, tuple[int, int]] = {}
        self.updated_at = -math.inf
        self.backoff = MIN_BACKOFF
        self.refresh_requested = True
        self.updates = 0
        # this map's shards as they are now, unique in the process (a new one each time a
        # refresh is published): what the key cache's placements remember (KeyFacts)
        self.version = next(_versions)

    def __repr__(self) -> str:
        return f"<ShardMap {self.state.value} {len(self._ids)} open shard(s)>"

    # -- lookups (hot path) ---------------------------------------------------------------

    def shard_id(self, hash_key: int) -> str | None:
        """The open shard whose range holds ``hash_key``, or ``None`` when not READY."""
        if not self.ready:
            return None
        i = bisect_left(self._ends, hash_key)
        if i == len(self._ids):
            return None
        return self._ids[i]

    def hash_range(self, shard_id: str) -> tuple[int, int] | None:
        """The (start, end) hash keys of a shard, open or recently closed, if known."""
        return self._ranges.get(shard_id)

    @property
    def open_shards(self) -> tuple[str, ...]:
        return tuple(self._ids)

    # -- updating ------------------------------------------------------------------------

    @property
    def updating(self) -> bool:
        """Whether a refresh is under way."""
        return self.state is ShardMapState.UPDATING

    def want_refresh(self) -> None:
        """Ask for a refresh without invalidating the map (it keeps predicting until the
        refresh starts): another one after the refresh under way, if there is one."""
        self.refresh_requested = True

    def begin_update(self) -> bool:
        """Start a refresh; False if one is already running."""
        if self.state is ShardMapState.UPDATING:
            return False
        self.state = ShardMapState.UPDATING
        self.ready = False
        self.refresh_requested = False
        self._pending_ends = []
        self._new_ranges = {}
        return True

    def apply_page(self, shards: list[Mapping[str, Any]]) -> None:
        """Add one ListShards page. Closed shards only update the range cache."""
        for shard in shards:
            shard_id = shard["ShardId"]
            hash_range = shard["HashKeyRange"]
            start, end = int(hash_range["StartingHashKey"]), int(hash_range["EndingHashKey"])
            self._new_ranges[shard_id] = (start, end)
            if shard.get("SequenceNumberRange", {}).get("EndingSequenceNumber") is None:
                self._pending_ends.append((end, shard_id))
        self.backoff = MIN_BACKOFF

    def finish_update(self, now: float) -> None:
        """The last page arrived: publish the new map."""
        pairs = sorted(self._pending_ends)
        self._ends = [end for end, _ in pairs]
        self._ids = [shard_id for _, shard_id in pairs]
        self._open = frozenset(self._ids)
        # keep recently closed shards' ranges; drop them CLOSED_SHARD_TTL after a refresh
        self._ranges.update(self._new_ranges)
        self._pending_ends = []
        self._new_ranges = {}
        self.state = ShardMapState.READY
        self.ready = True
        self.updated_at = now
        self.updates += 1
        self.version = next(_versions)

    def fail_update(self) -> float:
        """The refresh failed: back to INVALID; returns the delay before the next try."""
        self.state = ShardMapState.INVALID
        self.ready = False
        delay = self.backoff
        self.backoff = min(MAX_BACKOFF, self.backoff * BACKOFF_GROWTH)
        return delay

    def invalidate(self, seen_at: float, predicted_shard: str | None) -> bool:
        """Ask for a refresh because a request that started at ``seen_at`` found the map
        wrong; returns whether a refresh was requested (the KPL's guard)."""
        if (
            seen_at > self.updated_at
            and self.state is ShardMapState.READY
            and (predicted_shard is None or predicted_shard in self._open)
        ):
            # as the KPL's ShardMap::invalidate: the map predicts nothing until refreshed,
            # so records keep out of the stale ranges (they wait for the new map)
            self.state = ShardMapState.INVALID
            self.ready = False
            self.refresh_requested = True
            return True
        return False

    def drop_closed_ranges(self, now: float) -> None:
        """Forget the ranges of closed shards once the map is CLOSED_SHARD_TTL old."""
        if self.state is ShardMapState.READY and now - self.updated_at > CLOSED_SHARD_TTL:
            for shard_id in [s for s in self._ranges if s not in self._open]:
                del self._ranges[shard_id]
