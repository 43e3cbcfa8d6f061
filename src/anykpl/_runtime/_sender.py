"""The Sender: PutRecords requests → the transport → outcomes for the Retrier.

One task per stream. It keeps at most ``max_connections`` requests in flight, ends each after
``request_timeout``, and turns every answer or error into an
:class:`~anykpl._core._retrier.Outcome` (errors as codes, through the transport's
:func:`~anykpl._transport._botocore.error_code`). Cancellation is never turned into an
outcome: it propagates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._core._retrier import Outcome
from .._transport._botocore import error_code
from .._transport._protocol import Transport

__all__ = ("run_sender",)


async def run_sender(
    stream: str,
    transport: Transport,
    requests: MemoryObjectReceiveStream[list[Any]],
    outcomes: MemoryObjectSendStream[Outcome],
    *,
    max_connections: int,
    request_timeout: float,
) -> None:
    """Send each request with at most ``max_connections`` in flight; pass every outcome on."""
    slots = anyio.Semaphore(max_connections)

    async def send(batch: list[Any]) -> None:
        try:
            entries = [
                {
                    "Data": kr.data,
                    "PartitionKey": kr.partition_key,
                    "ExplicitHashKey": kr.explicit_hash_key,
                }
                for kr in batch
            ]
            start = anyio.current_time()
            response: Mapping[str, Any] | None = None
            code = message = None
            try:
                with anyio.fail_after(request_timeout):
                    response = await transport.put_records(stream, entries)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                code, message = error_code(exc)
            del entries
            for kr in batch:
                kr.release()  # an aggregate's bytes: the user records keep their own
            outcome = Outcome(stream, batch, start, anyio.current_time(), response, code, message)
            try:
                outcomes.send_nowait(outcome)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                # the Retrier is gone: the producer is shutting down and fails what is left
                return
        finally:
            slots.release()

    async with requests, outcomes, anyio.create_task_group() as tg:
        async for batch in requests:
            await slots.acquire()
            tg.start_soon(send, batch)
