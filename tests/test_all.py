"""``__all__`` stays honest (anyio's tests/test_all_attributes.py idea), in every public module:
every module whose dotted name has no part starting with an underscore, found by walking the
package's sources (a new public module is checked without being listed here)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from types import ModuleType

import pytest

import anykpl
from anykpl import errors

_PACKAGE = Path(anykpl.__file__).parent


def _public_module_names() -> list[str]:
    names = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        parts = ["anykpl", *path.relative_to(_PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if parts[-1] == "__main__" or any(part.startswith("_") for part in parts):
            continue
        names.append(".".join(parts))
    return names


PUBLIC_MODULES = _public_module_names()


def test_the_public_modules_are_found() -> None:
    for name in ("anykpl", "anykpl.errors", "anykpl.config", "anykpl.metrics", "anykpl.readback"):
        assert name in PUBLIC_MODULES


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_every_public_module_has_an_honest_all(name: str) -> None:
    module = importlib.import_module(name)
    names = module.__all__
    assert isinstance(names, tuple), name
    assert len(set(names)) == len(names), name
    missing = [attribute for attribute in names if not hasattr(module, attribute)]
    assert missing == [], name
    private = [attribute for attribute in names if attribute.startswith("_")]
    assert private == [], name


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
