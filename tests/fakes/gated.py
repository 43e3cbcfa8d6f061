"""A FakeKinesis whose PutRecords calls can be held at a gate, so a test can look at the
producer while requests are in flight (backpressure, close, flush ordering); and one whose
ListShards answers late (a stream's first batch waiting for its shard map)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from .kinesis import FakeKinesis


class GatedKinesis(FakeKinesis):
    """A FakeKinesis whose PutRecords calls wait for ``gate`` (when set) to open."""

    def __init__(self, shard_count: int = 4) -> None:
        super().__init__(shard_count)
        self.gate: anyio.Event | None = None
        self.entered: anyio.Event | None = None
        self.waiting = 0

    def close_gate(self) -> None:
        self.gate = anyio.Event()
        self.entered = anyio.Event()

    async def put_records(self, stream: str, records: list[dict[str, Any]]) -> Mapping[str, Any]:
        if self.gate is not None:
            self.waiting += 1
            assert self.entered is not None
            self.entered.set()
            await self.gate.wait()
            self.waiting -= 1
        return await super().put_records(stream, records)


class LateMapKinesis(FakeKinesis):
    """A FakeKinesis whose ListShards answers ``delay`` seconds late (a stream's first shard
    map that takes a while: ``submit_many``'s first batch waits for it)."""

    def __init__(self, delay: float, shard_count: int = 4) -> None:
        super().__init__(shard_count)
        self.late = delay

    async def list_shards(self, **kwargs: Any) -> Mapping[str, Any]:
        await anyio.sleep(self.late)
        return await super().list_shards(**kwargs)
