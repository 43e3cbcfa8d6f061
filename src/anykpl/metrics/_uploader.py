"""The producer's upload task: statistics out of :class:`~anykpl._core._metrics.Metrics`, reports
into the sinks, within the producer's close deadline.

A producer given sinks (``Producer(..., metrics_sinks=[...])``) runs one :class:`Uploader` in
its task group. Every ``metrics_upload_delay`` seconds it takes the statistics accumulated
since the previous upload (count, sum, min and max per metric and dimensions), filters them by
``metrics_level`` and ``metrics_granularity`` as the KPL does, and hands one
:class:`~anykpl.metrics.MetricsReport` to each sink — to all at once, each ``publish`` bounded
by :data:`PUBLISH_TIMEOUT` and ``metrics_upload_delay``. A sink that fails or hangs is logged on
the ``anykpl.metrics`` logger and counted; it never holds up the other sinks or reaches the
pipeline. A last report goes out when the producer closes, also when its block is left by
cancellation; closing, the last report and closing the sinks included, takes at most
``close_timeout`` + :data:`CLOSE_GRACE`. Without sinks no task runs and nothing extra is done.

The task lives apart from the sinks because it is the producer's, not theirs: it owns the
deadlines and the isolation between sinks, and knows them only through the
:class:`~anykpl.metrics.MetricsSink` protocol (``_sink.py``). The KPL's counterpart is the
upload half of ``aws/metrics/metrics_manager.cc``; unlike it, reports go to any number of
sinks, each bounded in time, and a last one goes out at close.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Final

import anyio

from .._core._metrics import Metrics, leaves, to_values, with_ancestors
from ._sink import MetricsReport, MetricsSink

if TYPE_CHECKING:
    from ..config import ProducerConfig

__all__ = (
    "CLOSE_GRACE",
    "FINAL_REPORT_MIN",
    "FINAL_REPORT_WHEN_CANCELLED",
    "PUBLISH_TIMEOUT",
    "SINK_CLOSE_MIN",
    "Uploader",
)

logger = logging.getLogger("anykpl.metrics")


#: The longest one sink's ``publish`` (or ``open``) may take; it is also bounded by
#: ``metrics_upload_delay``, so a slow sink never holds up the next report.
PUBLISH_TIMEOUT: Final = 30.0
#: What closing may add to ``close_timeout``: when the flush used all of it, the last report
#: still gets FINAL_REPORT_MIN seconds and closing the sinks SINK_CLOSE_MIN.
FINAL_REPORT_MIN: Final = 0.25
SINK_CLOSE_MIN: Final = 0.25
CLOSE_GRACE: Final = FINAL_REPORT_MIN + SINK_CLOSE_MIN
#: The bound of the last report when the producer's block is left by cancellation (or
#: ``close_timeout`` if smaller).
FINAL_REPORT_WHEN_CANCELLED: Final = 2.0


class Uploader:
    """The producer's upload task: one per producer, only when sinks are configured.

    Each report goes to every sink at once, each ``publish`` in its own task and bounded by
    :data:`PUBLISH_TIMEOUT` and ``metrics_upload_delay``: a sink that hangs or fails is logged
    and counted, and the others get their reports all the same. The task is shielded from
    cancellation around the producer, so that the last report goes out even then; the
    producer ends it with :meth:`close` (one deadline for the last report and closing the
    sinks) and :meth:`abort`.
    """

    def __init__(
        self, metrics: Metrics, sinks: Sequence[MetricsSink], config: ProducerConfig
    ) -> None:
        self.metrics = metrics
        self.sinks = tuple(sinks)
        self.config = config
        self.publish_timeout = min(config.metrics_upload_delay, PUBLISH_TIMEOUT)
        self.uploads = 0
        #: failed or timed-out ``publish`` (or ``open``) calls, per sink index
        self.failures = [0] * len(self.sinks)
        self._stop = anyio.Event()
        self._done = anyio.Event()
        self._close_deadline = -math.inf  # set by close(); closing without it is brief
        self._scope = anyio.CancelScope(shield=True)
        #: scopes of the open/publish calls running now: close() brings their deadlines in
        self._bounded_scopes: set[anyio.CancelScope] = set()
        metrics.enable_uploads()

    async def run(self) -> None:
        with self._scope:
            try:
                async with AsyncExitStack() as stack:
                    try:
                        await self._run(stack)
                    finally:
                        # close the sinks' clients even when cancelled, within the deadline
                        now = anyio.current_time()
                        bound = max(self._close_deadline, now + SINK_CLOSE_MIN)
                        bound = min(bound, now + self.publish_timeout)
                        with anyio.CancelScope(deadline=bound, shield=True):
                            await stack.aclose()
            finally:
                self._done.set()

    async def _run(self, stack: AsyncExitStack) -> None:
        opened: list[tuple[int, MetricsSink]] = []
        for index, sink in enumerate(self.sinks):
            deadline = anyio.current_time() + self.publish_timeout
            context = sink.open(self.config)
            if await self._bounded(index, "open", stack.enter_async_context, context, deadline):
                opened.append((index, sink))
        delay = self.config.metrics_upload_delay
        next_upload = anyio.current_time() + delay
        while True:
            with anyio.CancelScope(deadline=next_upload):
                await self._stop.wait()
            if self._stop.is_set():
                break
            now = anyio.current_time()
            next_upload = now + delay
            await self._publish(opened, final=False, deadline=now + self.publish_timeout)
        now = anyio.current_time()
        deadline = max(self._close_deadline, now + FINAL_REPORT_MIN)
        await self._publish(opened, final=True, deadline=min(deadline, now + self.publish_timeout))

    async def close(self, deadline: float) -> None:
        """Send the final report and close the sinks, by ``deadline`` (plus at most
        :data:`CLOSE_GRACE`). Shielded: it runs even in a cancelled scope."""
        self._close_deadline = deadline
        for scope in self._bounded_scopes:
            scope.deadline = min(scope.deadline, deadline)
        self._stop.set()
        with anyio.CancelScope(deadline=deadline + CLOSE_GRACE, shield=True):
            await self._done.wait()

    def abort(self) -> None:
        """End the task now (after :meth:`close`, or if it was never called)."""
        self._scope.cancel()

    def report(self, *, final: bool) -> MetricsReport:
        stats, start, end = self.metrics.take_unsent()
        config = self.config
        level, granularity = config.metrics_level, config.metrics_granularity
        duration = end - start
        return MetricsReport(
            timestamp=datetime.now(timezone.utc),
            duration=duration,
            values=to_values(with_ancestors(stats), duration, level=level, granularity=granularity),
            leaves=to_values(
                leaves(stats, granularity), duration, level=level, granularity=granularity
            ),
            final=final,
        )

    async def _publish(
        self, sinks: Sequence[tuple[int, MetricsSink]], *, final: bool, deadline: float
    ) -> None:
        report = self.report(final=final)
        self.uploads += 1
        async with anyio.create_task_group() as tg:
            for index, sink in sinks:
                tg.start_soon(self._bounded, index, "publish", sink.publish, report, deadline)

    async def _bounded(
        self,
        index: int,
        what: str,
        call: Callable[[Any], Awaitable[object]],
        arg: Any,
        deadline: float,
    ) -> bool:
        """``await call(arg)`` by ``deadline`` (brought in by :meth:`close`); ``False`` if it
        raised or ran out of time (logged, and counted in :attr:`failures`)."""
        sink = self.sinks[index]
        with anyio.CancelScope(deadline=deadline) as scope:
            self._bounded_scopes.add(scope)
            try:
                await call(arg)
            except Exception:
                self.failures[index] += 1
                logger.exception("metrics sink %r failed to %s", sink, what)
                return False
            finally:
                self._bounded_scopes.discard(scope)
            return True
        self.failures[index] += 1
        logger.warning(
            "metrics sink %r did not %s in time (report dropped for this sink)", sink, what
        )
        return False
