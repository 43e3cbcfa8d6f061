"""The Sender: PutRecords requests → the transport → outcomes for the Retrier.

One task per stream. It keeps at most ``max_connections`` requests in flight, ends each after
``request_timeout``, and turns every answer or error into an
:class:`~anykpl._core._retrier.Outcome` (errors as codes, through the transport's
:func:`~anykpl._transport._botocore.error_code`). Cancellation is never turned into an
outcome: it propagates.

It also keeps the bytes in flight within the path's window (``_core/_network.py``): unlimited
until a request times out or the path stalls; after that a request waits for room in the
window, and one bigger than the window allows is split into requests of its own (``on_split``
counts the extra ones), each with its own outcome. When the path stalls, the requests in
flight beyond what the new window holds (those whose records have the most time left) are
abandoned at once, as if they had timed out: sharing the path, none of them would be answered
in time, and their bytes would only hold back the records that expire first (the transport's
connections close abortively, so their unsent bytes go nowhere).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._core._network import NetworkWindow
from .._core._retrier import Outcome
from .._transport._botocore import error_code
from .._transport._protocol import Transport
from ..errors import TIMEOUT

__all__ = ("run_sender",)


async def run_sender(
    stream: str,
    transport: Transport,
    requests: MemoryObjectReceiveStream[list[Any]],
    outcomes: MemoryObjectSendStream[Outcome],
    *,
    max_connections: int,
    request_timeout: float,
    window: NetworkWindow | None = None,
    on_split: Callable[[int], None] | None = None,
    on_take: Callable[[], None] | None = None,
) -> None:
    """Send each request with at most ``max_connections`` in flight, and its bytes within
    ``window`` (if given); pass every outcome on. ``on_split(n)``: a request was split into
    ``n`` more; ``on_take()``: a request was taken from ``requests``."""
    slots = anyio.Semaphore(max_connections)
    answered = anyio.Event()  # set when a request ends: a wait for room in the window looks again
    flight_changed = anyio.Event()  # set when a request goes or ends: the stall watch looks again
    #: the requests in flight in the window: send time, bytes, the scope that abandons it, and
    #: its Kinesis records
    in_flight: dict[object, tuple[float, int, anyio.CancelScope, list[Any]]] = {}

    async def send(batch: list[Any], size: int = 0, sent_at: float = 0.0, flight: int = 0) -> None:
        nonlocal answered, flight_changed
        abandon = anyio.CancelScope()
        if window is not None:
            in_flight[abandon] = (sent_at, size, abandon, batch)
            flight_changed.set()
            flight_changed = anyio.Event()
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
                with abandon, anyio.fail_after(request_timeout):
                    response = await transport.put_records(stream, entries)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:
                code, message = error_code(exc)
            if abandon.cancelled_caught:
                code, message = TIMEOUT, "abandoned: the network path stalled"
            if window is not None:
                del in_flight[abandon]
                flight_changed.set()
                flight_changed = anyio.Event()
                now = anyio.current_time()
                if response is not None:
                    window.answered(size, sent_at, now)
                elif code == TIMEOUT:
                    window.timed_out(size, sent_at, flight, now)
                else:
                    window.failed(size, sent_at)
                answered.set()
                answered = anyio.Event()
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

    async def room(size: int) -> None:
        assert window is not None
        while not window.room(size, anyio.current_time()):
            with anyio.move_on_after(max(0.0, window.next_probe() - anyio.current_time())):
                await answered.wait()

    watching = anyio.CancelScope()  # the stall watch's: ended with the requests

    async def watch_stalls() -> None:
        """Check the window for a stall when one could be found; abandon what a stall
        leaves beyond the window."""
        assert window is not None
        seen = window.stalls
        with watching:
            while True:
                wait = window.next_stall_check(anyio.current_time()) - anyio.current_time()
                with anyio.move_on_after(max(0.0, wait)):
                    await flight_changed.wait()
                window.check_stall(anyio.current_time())
                if window.stalls == seen:
                    continue
                seen = window.stalls
                # keep the requests whose records expire first, as many as the new window
                # holds (at least one), and abandon the rest: a record retried after an
                # abandoned attempt is kept the next time, not abandoned again as the newest
                kept = 0
                for _, size, scope, _ in sorted(
                    in_flight.values(),
                    key=lambda request: (min(kr.expiration for kr in request[3]), request[0]),
                ):
                    if kept and kept + size > window.window:
                        scope.cancel()
                    else:
                        kept += size

    async with requests, outcomes, anyio.create_task_group() as tg:
        if window is not None:
            tg.start_soon(watch_stalls)
        async for batch in requests:
            if on_take is not None:
                on_take()
            if window is None:
                await slots.acquire()
                tg.start_soon(send, batch)
                continue
            sizes = [kr.size for kr in batch]
            ends = window.split(sizes) if window.limited else [len(batch)]
            if len(ends) > 1 and on_split is not None:
                on_split(len(ends) - 1)
            start = 0
            for end in ends:
                part = batch if end - start == len(batch) else batch[start:end]
                size = sum(sizes[start:end])
                start = end
                await slots.acquire()
                await room(size)
                now = anyio.current_time()
                tg.start_soon(send, part, size, now, window.sent(size, now))
        watching.cancel()
