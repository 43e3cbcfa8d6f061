"""What anykpl runs on: the build (compiled or pure, and ``mypyc_attr`` for the modules the
compiled build compiles, with or without mypy installed) and the event loop
(:func:`running_trio`).

mypyc reads ``@mypyc_attr(...)`` when it builds the compiled package; at run time the decorator
does nothing. ``mypy_extensions`` (where it lives) is not a dependency of anykpl, so without it
this module's stand-in is used. Not compiled itself: a compiled module treats the ``else``
branch below as unreachable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

__all__ = ("build_kind", "gc_untracker", "mypyc_attr", "running_trio")

_T = TypeVar("_T")

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr as mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:

        def mypyc_attr(*attrs: object, **kwattrs: object) -> Callable[[_T], _T]:
            return lambda cls: cls


def gc_untracker(sample: object) -> Callable[[int], None] | None:
    """A function that tells the cyclic garbage collector to stop tracking the object at an
    address (``untrack(id(obj))``, the caller holding ``obj``) of ``sample``'s type, or
    ``None`` when there is nothing to do or no way to do it.

    The compiled build declares its records acyclic (``mypyc_attr(acyclic=True)``): they are
    not containers the collector tracks. A class of the pure package always is one, and a
    producer's records, one per user record from submit to its result and for as long as the
    caller keeps the handles, set off collections that walk everything the process holds: a
    quarter to a third of a pure firehose's CPU (docs/benchmarks.md). The same records are
    made untracked on CPython through its public C API (``PyObject_GC_UnTrack``, by
    ``ctypes``), so the two builds treat them alike. The object goes by its address (its
    ``id`` on CPython): a third cheaper a call than passing the object. ``None`` where
    ``sample`` is not tracked (the compiled build) or where that API is not reachable
    (another interpreter).
    """
    import gc
    import sys

    if not gc.is_tracked(sample) or sys.implementation.name != "cpython":
        return None
    try:
        import ctypes

        function = ctypes.PYFUNCTYPE(None, ctypes.c_void_p)(
            ("PyObject_GC_UnTrack", ctypes.pythonapi)
        )
    except (ImportError, AttributeError, OSError):  # pragma: no cover - a CPython without it
        return None
    function(id(sample))
    if gc.is_tracked(sample):  # pragma: no cover - not expected on CPython
        return None
    return function


def build_kind() -> str:
    """``"compiled"`` if the hot path runs compiled (a wheel built with a C compiler, see
    hatch_build.py), ``"pure Python"`` otherwise."""
    from ._core import _wire  # compiled with the hot path, and imports nothing that imports this

    return "pure Python" if _wire.__file__.endswith(".py") else "compiled"


def running_trio() -> bool:
    """Whether the caller runs under trio (the producer's clocks and the HTTP client the
    transport picks depend on it)."""
    try:
        import sniffio
    except ImportError:  # pragma: no cover - trio depends on sniffio
        return False
    try:
        return bool(sniffio.current_async_library() == "trio")
    except sniffio.AsyncLibraryNotFoundError:
        return False
