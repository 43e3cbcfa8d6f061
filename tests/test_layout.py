"""The layout is the architecture, and these tests keep it so (docs/architecture.md, "The
house"): the sans-IO core imports no event loop and no SDK, and is exactly what the compiled
build compiles; the transport is the only place botocore is seen; the library never imports
the tools.

Imports are read from the sources (every ``import``, at module level, in functions and under
``TYPE_CHECKING``), not from what a running interpreter happened to load.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest's own dependency there
    import tomli as tomllib

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "anykpl"

#: what the core may import of the package besides itself: all of it pure, none of it async
CORE_MAY_IMPORT = {"anykpl.errors", "anykpl.config", "anykpl._kpl_properties", "anykpl._compat"}
#: event loops, SDKs and HTTP clients: the core and what it may import never import these
#: (``_compat.running_trio`` asks sniffio which event loop runs, and runs none)
ASYNC_OR_SDK = {"anyio", "trio", "botocore", "aiobotocore", "aiohttp", "httpx", "httpx2"}
#: botocore is seen by the transport only, and by the modules that make other AWS clients for
#: the fleet's stores, the schema registry and the tools
BOTOCORE = {"botocore", "aiobotocore"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


@cache
def _imports(name: str) -> frozenset[str]:
    """Every module ``name`` imports: dotted names, absolute."""
    path = _modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            found.update(sub for sub in submodules if sub in _modules())
            if not all(sub in _modules() for sub in submodules):
                found.add(module)  # names from the module itself
    found.discard(name)
    return frozenset(found)


def _top_levels(name: str) -> set[str]:
    return {imported.partition(".")[0] for imported in _imports(name)}


def _package_imports(name: str) -> set[str]:
    return {imported for imported in _imports(name) if imported in _modules()}


def _closure(start: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(_package_imports(name) - seen)
    return seen


def _core() -> set[str]:
    return {name for name in _modules() if name.startswith("anykpl._core.")}


def test_the_layers_exist() -> None:
    for package in ("_core", "_runtime", "_transport", "_commands", "_fleet"):
        assert (PACKAGE / package / "__init__.py").is_file(), package
    # the layout a newcomer reads: the stages in the core, no private module left at the top
    # but the facade of the sync world, the KPL properties reader and the build helper
    top = {path.stem for path in PACKAGE.glob("_*.py")} - {"__init__"}
    assert top == {"_sync", "_kpl_properties", "_compat"}
    for stage in ("_aggregator", "_limiter", "_collector", "_retrier", "_shard_map", "_wire"):
        assert f"anykpl._core.{stage}" in _modules(), stage


def test_the_core_imports_no_event_loop_and_no_sdk() -> None:
    reached = _closure(_core())
    assert reached - _core() <= CORE_MAY_IMPORT, sorted(reached - _core() - CORE_MAY_IMPORT)
    for name in sorted(reached):
        assert not _top_levels(name) & ASYNC_OR_SDK, (name, sorted(_top_levels(name)))


def test_the_core_is_what_the_compiled_build_compiles() -> None:
    pyproject = tomllib.loads((SRC.parent / "pyproject.toml").read_text())
    include = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["hooks"]["custom"]["include"]
    assert include == ["/src/anykpl/_core"]


def test_botocore_is_seen_only_by_the_transport_and_the_other_aws_clients() -> None:
    allowed = ("anykpl._transport.", "anykpl._fleet.", "anykpl._commands.", "anykpl.emulator")
    seen = {name for name in _modules() if _top_levels(name) & BOTOCORE}
    assert {name for name in seen if not name.startswith(allowed)} == {
        "anykpl.metrics._cloudwatch",  # the CloudWatch sink's client
        "anykpl.schema_registry",  # reads schemas from Glue, a client of its own
        "anykpl.testing",  # the fixture's client for reading a stream back
    }


def test_the_library_imports_no_tool() -> None:
    library = {name for name in _modules() if not name.startswith("anykpl._commands")}
    for name in sorted(library):
        tools = {imported for imported in _imports(name) if imported.startswith("anykpl._commands")}
        assert not tools, (name, sorted(tools))


def test_no_module_reaches_into_another_layers_private_module_by_path() -> None:
    # within the package, imports are relative; the absolute names of private modules are
    # for tests and tools
    for name, path in sorted(_modules().items()):
        if name.startswith("anykpl._commands") or name == "anykpl.emulator.__main__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                assert not node.module.startswith("anykpl._"), (name, node.module)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _in_stdlib(module: str) -> bool:
    return module.partition(".")[0] in sys.stdlib_module_names


def test_the_library_uses_no_private_name_of_the_standard_library() -> None:
    # ``threading._register_atexit`` and the like change without notice between Pythons: as
    # ``module._name``, ``a.b._name``, ``from module import _name``, ``import a._b`` or
    # ``getattr(module, "_name")``, on a module or on a name imported from one
    for name, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text())
        stdlib: set[str] = set()  # the names bound to standard-library modules or their names
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _in_stdlib(alias.name):
                        assert not any(map(_private, alias.name.split("."))), (where, alias.name)
                        stdlib.add(alias.asname or alias.name.partition(".")[0])
            elif (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and _in_stdlib(node.module or "")
            ):
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    assert not any(map(_private, dotted.split("."))), (where, dotted)
                    stdlib.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute):
                chain = [node.attr]
                value = node.value
                while isinstance(value, ast.Attribute):  # a.b.c._d
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in stdlib:
                    dotted = ".".join([value.id, *reversed(chain)])
                    assert not any(map(_private, chain)), f"{where}: {dotted}"
            elif (  # getattr(threading, "_register_atexit", None)
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in stdlib
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                attribute = node.args[1].value
                assert not _private(attribute), f"{where}: {node.args[0].id}.{attribute}"
