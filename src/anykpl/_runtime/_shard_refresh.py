"""The shard map's async shell: ListShards when a refresh is requested, with backoff.

Kept out of the compiled build, with the other coroutines (see ``_awaiting``): a coroutine
compiled by mypyc passes a cancellation on with ``throw()``'s three-argument form, which Python
3.12 and later deprecate, and this task is cancelled whenever a producer closes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio

from .._core._shard_map import CLOSED_SHARD_TTL, ShardMap
from .._transport._protocol import stream_parameters

__all__ = ("ListShards", "run_shard_map")

logger = logging.getLogger("anykpl.shard_map")


ListShards = Callable[..., Awaitable[Mapping[str, Any]]]


async def run_shard_map(
    shard_map: ShardMap,
    stream: str,
    list_shards: ListShards,
    wake: Callable[[], anyio.Event],
    on_ready: Callable[[], None] = lambda: None,
    on_failure: Callable[[BaseException], bool] = lambda exc: True,
) -> None:
    """Keep ``shard_map`` fresh for ``stream``: refresh when requested, retry with backoff.

    ``wake()`` returns the event that is set when somebody requests a refresh; ``on_ready()``
    is called after every successful refresh, ``on_failure(exc)`` after every failed one: it
    returns whether to try again after the backoff (``False`` for an error a retry cannot
    fix, such as a missing stream: the next try waits for a refresh request, and the
    backoff).
    """
    while True:
        if shard_map.refresh_requested and shard_map.begin_update():
            try:
                response = await list_shards(
                    **stream_parameters(stream),
                    MaxResults=1000,
                    ShardFilter={"Type": "AT_LATEST"},
                )
                shard_map.apply_page(response.get("Shards", []))
                while token := response.get("NextToken"):
                    response = await list_shards(NextToken=token, MaxResults=1000)
                    shard_map.apply_page(response.get("Shards", []))
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                delay = shard_map.fail_update()
                retry = on_failure(exc)
                logger.warning(
                    "ListShards for %s failed (%s); %s in %.1f s",
                    stream,
                    exc,
                    "retrying" if retry else "trying again when records come, at the earliest",
                    delay,
                    extra={"stream": stream, "retry_in": delay},
                )
                await anyio.sleep(delay)
                if retry:
                    shard_map.refresh_requested = True
                continue
            shard_map.finish_update(anyio.current_time())
            on_ready()
            logger.info(
                "shard map of %s refreshed: %d open shard(s)",
                stream,
                len(shard_map.open_shards),
                extra={"stream": stream, "open_shards": len(shard_map.open_shards)},
            )
        event = wake()
        if not shard_map.refresh_requested:
            with anyio.move_on_after(CLOSED_SHARD_TTL / 2):
                await event.wait()
            shard_map.drop_closed_ranges(anyio.current_time())
