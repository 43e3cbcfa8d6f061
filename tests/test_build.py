"""What the compiled build (hatch_build.py, mypyc) may hold."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def compiled_modules() -> list[Path]:
    """The modules listed for mypyc under ``[tool.hatch.build.targets.wheel.hooks.custom]``
    (files, or directories: every module in them)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[tool.hatch.build.targets.wheel.hooks.custom]", 1)[1].split("\n[", 1)[0]
    listed = re.findall(r'"/(src/anykpl/[\w/.]+)"', section)
    modules = [
        module
        for path in listed
        for module in (
            [ROOT / path] if path.endswith(".py") else sorted((ROOT / path).rglob("*.py"))
        )
    ]
    assert modules, "no compiled module found in pyproject.toml"
    return modules


def test_the_compiled_modules_hold_no_coroutine() -> None:
    # A coroutine compiled by mypyc passes a cancellation on to what it awaits with
    # throw()'s three-argument form, deprecated since Python 3.12 (mypyc/mypyc#1214): a
    # cancelled `await pending` warned, and a producer's close crashed its shard-map task
    # where warnings are errors. Coroutines live in interpreted modules (anykpl._runtime._awaiting,
    # anykpl._runtime._shard_refresh). A generator that never suspends (_records._ready) or is only
    # iterated (FairQueue.__iter__) has nothing thrown into it.
    found = []
    for path in compiled_modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.AsyncFunctionDef, ast.Await)):
                found.append(f"{path.name}:{node.lineno}: {type(node).__name__}")
    assert not found, found
