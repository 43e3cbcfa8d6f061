"""The wheel's build hook: the hot path compiled with mypyc where it can be, pure where not.

``pip install .`` and ``python -m build`` make a wheel with the modules listed under
``[tool.hatch.build.targets.wheel.hooks.custom]`` in pyproject.toml compiled by mypyc (the
stages every record passes through, compiled unchanged), as yarl, multidict and msgpack do. The
build falls back to the pure package, with a warning, when compiling fails (no C compiler, no
Python headers); ``ANYKPL_PURE=1`` forces the pure package. Editable installs
(``pip install -e .``) are always pure, so that an edit to a source file takes effect.
``anykpl --version`` says which build is running.

The compiler writes its modules beside the sources (``build_ext --inplace``); they are taken
into the wheel and removed from the source tree once the wheel is written, so that they never
shadow the sources of a work tree the wheel was built from.
"""

from __future__ import annotations

import os
from typing import Any

from hatch_mypyc.plugin import MypycBuildHook

#: Set (to anything but "" or "0") to build the pure package.
PURE_ENV = "ANYKPL_PURE"


class CompiledWhereItCanBe(MypycBuildHook):  # type: ignore[misc]
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        self._compiled = False
        if self.target_name != "wheel":
            return
        if version == "editable":
            self.app.display_info("anykpl: editable install, pure Python")
            return
        if os.environ.get(PURE_ENV, "") not in ("", "0"):
            self.app.display_info(f"anykpl: {PURE_ENV} is set, pure Python")
            return
        try:
            super().initialize(version, build_data)
        except Exception as exc:  # the compiler failed: no C compiler, headers, ...
            self.clean([version])
            message = str(exc).strip().splitlines()
            tail = "\n".join(message[-12:])
            self.app.display_warning(
                "anykpl: the compiled hot path could not be built; installing the pure "
                f"package (same behaviour, slower). The compiler said:\n{tail}"
            )
            return
        self._compiled = True
        self.app.display_info("anykpl: the hot path is compiled (mypyc)")

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        if getattr(self, "_compiled", False):
            # in the wheel now: out of the source tree, where they would shadow the sources
            self.clean([version])


def get_build_hook() -> type[CompiledWhereItCanBe]:
    """The hook hatchling loads from this file (the import above is a hook class too)."""
    return CompiledWhereItCanBe
