"""Admission: the one place where a record waits for room.

Whether a record fits is :meth:`Intake.has_room <anykpl._core._intake.Intake.has_room>` — the
producer's caps, the record's own shard's backlog against what that shard delivers now, a fair
share of the caps per shard once they run short, the spool — kept with the per-record steps so
that the compiled build compiles it with them (see ``_intake.py`` and docs/admission.md). This
module owns the rest: the wait until the record fits, its bound (``admission_timeout``), the
message that says what held the record, and the end of every wait when the producer closes.

Every path in calls it: :meth:`Producer.submit` and :meth:`Producer.submit_many` (and so
``put_record`` and :class:`~anykpl.SyncProducer`, which admits through ``submit``), and the
records recovered from the spool.

A waiter is woken whenever room may have come: records finished (``Intake.on_finish``) or a
backlog limit grew (the pipeline's plan). Each waiter checks its own record again, so a record
for a quiet shard is admitted as soon as its shard has room, whatever a hot shard's callers
are waiting for.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import anyio

from .. import errors
from .._core._intake import Intake, StreamIntake
from .._core._records import Record

__all__ = ("Admission",)


class Admission:
    """The waits for room of one producer (see the module's docstring)."""

    def __init__(
        self,
        intake: Intake,
        timeout: float | None,
        not_open: Callable[[], errors.ProducerClosedError],
    ) -> None:
        self._intake = intake
        self.timeout = timeout  # admission_timeout
        # the error a wait raises once the producer is not open (its own message)
        self._not_open = not_open
        self._closed = False
        self._room: anyio.Event | None = None
        #: the waits for room begun so far, and those under way (a fleet worker's sign that
        #: its producer holds callers back)
        self.waits = 0
        self.waiting = 0

    def close(self) -> None:
        """The producer is closing: every wait ends with ``ProducerClosedError``, and so does
        every wait that starts from now on."""
        self._closed = True
        self.wake()

    def wake(self) -> None:
        """Room may have come (records finished, or a backlog limit grew): the waiters check
        their records again."""
        room = self._room
        if room is not None:
            self._room = None
            room.set()

    async def wait(
        self,
        record: Record,
        stream: StreamIntake,
        *,
        waited: float = 0.0,
        recovered: bool = False,
    ) -> None:
        """Wait until ``record`` fits in ``stream``. The caller admits it then, with no
        checkpoint in between (the room is not reserved).

        ``waited``: seconds the record already waited for admission (its tenant's tokens):
        ``admission_timeout`` bounds both waits together. A ``recovered`` record (from the
        spool) waits without a bound, and past the spool's own checks.

        :raises ~anykpl.errors.BackpressureTimeout: no room within ``admission_timeout``; the
            message names what held the record.
        :raises ~anykpl.errors.ProducerClosedError: the producer is closing.
        """
        intake = self._intake
        backlog = record.backlog
        if backlog is not None:  # where the check that sent it here placed it
            backlog.waits += 1
        timeout = None if recovered else self.timeout
        limit = math.inf if timeout is None else max(0.0, timeout - waited)
        self.waits += 1
        self.waiting += 1
        try:
            with anyio.fail_after(limit):
                while not intake.has_room(record, stream, recovered):
                    if self._closed:
                        raise self._not_open()
                    room = self._room
                    if room is None:
                        room = self._room = anyio.Event()
                    await room.wait()
        except TimeoutError:
            raise errors.BackpressureTimeout(
                f"no room for the record within admission_timeout={timeout} s "
                f"({intake.no_room_reason(record, stream)})"
            ) from None
        finally:
            self.waiting -= 1
        if self._closed:
            raise self._not_open()
