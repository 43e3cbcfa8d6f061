"""Shared fixtures: both anyio backends (or trio's autojump clock), a fake Kinesis transport,
and the ``integration`` marker on everything under ``tests/integration/``.

Every async test runs twice, on asyncio and on trio. A test (or class, or module) marked
``@pytest.mark.autojump`` runs once instead, on trio with ``MockClock(autojump_threshold=0)``:
whenever every task is blocked, virtual time jumps to the next deadline, so rate limits, TTLs
and leases play out in milliseconds without sleeping. The clock is made here and only here
(trio's own tests define their ``autojump_clock`` fixture once the same way).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from trio.testing import MockClock

from .fakes import FakeKinesis

#: The ``anyio_backend`` parameter of tests marked ``autojump``.
AUTOJUMP = "trio-autojump"

INTEGRATION = Path(__file__).parent / "integration"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "anyio_backend" in metafunc.fixturenames:
        if metafunc.definition.get_closest_marker("autojump") is not None:
            backends = [AUTOJUMP]
        else:
            backends = ["asyncio", "trio"]
        metafunc.parametrize("anyio_backend", backends, indirect=True)


@pytest.fixture
def anyio_backend(request: pytest.FixtureRequest) -> str | tuple[str, dict[str, object]]:
    """The backend of one run, parametrized by ``pytest_generate_tests`` above; a fresh
    autojump clock for each test marked ``autojump``."""
    backend = str(request.param)
    if backend == AUTOJUMP:
        return ("trio", {"clock": MockClock(autojump_threshold=0)})
    return backend


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(INTEGRATION):
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def fake_kinesis() -> FakeKinesis:
    return FakeKinesis()
