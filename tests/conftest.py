"""Shared fixtures: both anyio backends, a fake Kinesis transport, and moto's server."""

from __future__ import annotations

import pytest

pytest_plugins = ("tests.fakes",)


@pytest.fixture(
    params=[
        pytest.param("asyncio", id="asyncio"),
        pytest.param("trio", id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
