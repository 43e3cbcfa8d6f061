"""``__all__`` stays honest (anyio's tests/test_all_attributes.py idea)."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

import anykpl
from anykpl import errors


def _defined_in_anykpl(obj: object) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "anykpl" or module.startswith("anykpl.")


@pytest.mark.parametrize("module", [anykpl, errors], ids=["anykpl", "anykpl.errors"])
def test_all_is_a_tuple_of_existing_names(module: ModuleType) -> None:
    assert isinstance(module.__all__, tuple)
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), name


@pytest.mark.parametrize("module", [anykpl, errors], ids=["anykpl", "anykpl.errors"])
def test_every_public_class_and_function_is_exported(module: ModuleType) -> None:
    missing = [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and _defined_in_anykpl(obj)
        and name not in module.__all__
    ]
    assert missing == []


def test_public_names_of_the_spec() -> None:
    for name in ("Producer", "ProducerConfig", "RecordResult", "Attempt", "PendingRecord"):
        assert name in anykpl.__all__
    assert "errors" in anykpl.__all__
    assert anykpl.errors is errors


def test_reexported_classes_claim_the_package() -> None:
    for name in anykpl.__all__:
        obj = getattr(anykpl, name)
        if inspect.isclass(obj):
            assert obj.__module__ in ("anykpl", "anykpl.config"), name
