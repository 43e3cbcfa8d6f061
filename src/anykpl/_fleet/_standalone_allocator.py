"""The allocator on its own, without a producer: :class:`FleetAllocator`, which
``anykpl fleet-allocator`` (``fleet_allocator.py``) runs.

It competes for the lease like any :class:`~anykpl._fleet._member.Member` and writes a small
presence object instead of a report. See docs/fleet.md ("The standalone allocator").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import suppress

import anyio
import anyio.abc

from ..config import FleetConfig, ProducerConfig
from ._documents import GrantsDocument
from ._member import ClientFactory, Member
from ._store import Conflict, Store

__all__ = ("FleetAllocator",)


class FleetAllocator(Member):
    """The allocator alone, without a producer (``anykpl fleet-allocator``).

    It competes for the lease like any member (run the workers with ``elect=False`` to leave
    the role to it) and, since it writes no report, PUTs a small presence object
    ``allocators/<id>.json`` each cycle: that keeps its estimate of S3's clock fresh where S3
    sends no ``Date`` header, and shows operators which allocators run.
    ``on_allocation(document)`` is called after each generation it writes.
    """

    _role_name = "standby"
    _backs_off = False  # (a few standbys: they must see the lease run out in time)

    def __init__(
        self,
        fleet: FleetConfig,
        config: ProducerConfig,
        *,
        allocator_id: str | None = None,
        client_factory: ClientFactory | None = None,
        on_allocation: Callable[[GrantsDocument], None] | None = None,
    ) -> None:
        super().__init__(
            fleet,
            config,
            member_id=allocator_id or fleet.worker_id or f"allocator-{os.urandom(6).hex()}",
            client_factory=client_factory,
            on_allocation=on_allocation,
        )

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Allocate (whenever it holds the lease) until cancelled or :meth:`aclose`."""
        self._done = anyio.Event()
        self._stop_event = anyio.Event()
        try:
            with anyio.CancelScope() as self._run_scope:
                task_status.started()
                await self._serve()
        finally:
            self._done.set()

    def _probe(self, store: Store) -> tuple[str, bytes]:
        presence = {"allocator": self.worker_id, "incarnation": self._incarnation}
        return store.key(f"allocators/{self.worker_id}.json"), json.dumps(presence).encode()

    async def _cycle(self, store: Store) -> None:
        await self._attempt("write presence", store.put(*self._probe(store)))
        grants = await self._read_grants(store)
        if grants is not None and grants.document is not None:
            self._follow(grants.document)  # (a standby keeps to the fleet's interval)
        status = await self._lease_step(store)
        if status in ("held", "acquired"):
            await self._allocate_held(store, grants, status)

    async def _cleanup(self, store: Store) -> None:
        with suppress(Conflict):
            await self._attempt(
                "delete presence", store.delete(store.key(f"allocators/{self.worker_id}.json"))
            )
        await self._release(store)
