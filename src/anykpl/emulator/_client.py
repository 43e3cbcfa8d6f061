"""``EmulatorClient``: the emulator's control endpoint from Python, over plain HTTP.

One client for both kinds of emulator (in this process or its own), so tests, the demo and the
benchmarks drive them the same way. It is synchronous (``urllib``): control calls are rare and
short; from async code wrap them in ``anyio.to_thread.run_sync`` if a few milliseconds of
blocking matter.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from typing import Any

from ._options import Faults, Reshard, Storm, to_json

__all__ = ("EmulatorClient", "EmulatorControlError")


class EmulatorControlError(RuntimeError):
    """The control endpoint refused a call (bad option values, unknown stream, ...)."""


class EmulatorClient:
    """Control an emulator at ``url`` (``http://127.0.0.1:PORT``)."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"EmulatorClient({self.url!r})"

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}/_anykpl/{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):
                detail = json.loads(detail)["error"]
            raise EmulatorControlError(f"{method} /_anykpl/{path}: {detail}") from None

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "health")
        return result

    def stats(self) -> dict[str, Any]:
        """Per-shard accepted/throttled records and bytes, totals and per second
        (docs/emulator.md shows the document)."""
        result: dict[str, Any] = self._call("GET", "stats")
        return result

    def reset_stats(self) -> None:
        self._call("POST", "stats/reset", {})

    def faults(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "faults")
        return result

    def set_faults(self, **changes: Any) -> dict[str, Any]:
        """Change some fault settings (``Faults`` field names); the rest stay as they are."""
        result: dict[str, Any] = self._call("POST", "faults", changes)
        return result

    def clear_faults(self) -> dict[str, Any]:
        """Every fault setting back to its default (no faults)."""
        return self.set_faults(**to_json(Faults()))

    def limits(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "limits")
        return result

    def set_limits(self, **changes: Any) -> dict[str, Any]:
        """Change the per-shard limits (``Limits`` field names: ``enabled``,
        ``records_per_second``, ``bytes_per_second``)."""
        result: dict[str, Any] = self._call("POST", "limits", changes)
        return result

    def storm(
        self,
        stream: str,
        *,
        duration: float,
        factor: float = 0.1,
        shard_id: str | None = None,
        start: float = 0.0,
    ) -> None:
        """Cut a shard's limits (every shard's with ``shard_id=None``) to ``factor`` for
        ``duration`` seconds, ``start`` seconds from now."""
        storm = Storm(
            stream=stream, duration=duration, factor=factor, shard_id=shard_id, start=start
        )
        self._call("POST", "storms", to_json(storm))

    def reshard(
        self,
        stream: str,
        action: str,
        *,
        at: float = 0.0,
        shard_id: str | None = None,
        target: int | None = None,
    ) -> None:
        """Split or merge a shard, or scale the stream to ``target`` shards, ``at`` seconds from
        now. The outcome is listed under ``stats()["reshards"]``."""
        reshard = Reshard(stream=stream, action=action, at=at, shard_id=shard_id, target=target)  # type: ignore[arg-type]
        self._call("POST", "reshards", to_json(reshard))

    def create_stream(self, name: str, shards: int = 1, region: str | None = None) -> None:
        """Create a stream (in the emulator's default region unless ``region`` is given)."""
        self._call("POST", "streams", {"name": name, "shards": shards, "region": region})
