"""Developer sessions.

- ``nox -s tests lint typecheck`` (the default): the full suite, ruff and mypy, on the
  interpreter nox runs on;
- ``nox -s fast`` the fast suite (``-m "not integration"``) on every supported Python, 3.10 to
  3.13 (``nox -s fast-3.10`` for one); ``.ci/run`` runs it on 3.10 and 3.13 besides the full
  suite on 3.11;
- ``nox -s package``: build the sdist and wheel and ``twine check`` them;
- ``nox -s bench``, ``nox -s demo``, ``nox -s docs``.

Interpreters that pyenv installed are found without ``pyenv global`` naming them.
"""

from __future__ import annotations

import glob
import os
import subprocess
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]

PYTHONS = ["3.10", "3.11", "3.12", "3.13"]


def _pyenv_interpreters_on_path() -> None:
    """Put pyenv's installed versions on PATH, so that ``python3.10`` and the others resolve
    (pyenv's shims only serve the versions ``pyenv global`` names)."""
    try:
        root = subprocess.run(
            ["pyenv", "root"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return
    bins = sorted(str(path) for path in Path(root, "versions").glob("3.*/bin"))
    os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), *bins])


_pyenv_interpreters_on_path()


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHONS)
def fast(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "not integration", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("mypy")


@nox.session
def package(session: nox.Session) -> None:
    session.install("build", "twine")
    session.run("python", "-m", "build", "--outdir", "dist")
    session.run("python", "-m", "twine", "check", "--strict", *sorted(glob.glob("dist/*")))


@nox.session
def wheels(session: nox.Session) -> None:
    """The release wheels of this machine's platform ([tool.cibuildwheel] in pyproject.toml;
    Linux wheels need Docker or Podman), then the pure wheel, in wheelhouse/."""
    session.install("cibuildwheel", "build")
    # this machine's own architectures only (pyproject.toml lists the release's, some of
    # which need emulation here)
    session.run(
        "cibuildwheel", "--output-dir", "wheelhouse", *session.posargs, env={"CIBW_ARCHS": "native"}
    )
    session.run(
        "python", "-m", "build", "--wheel", "--outdir", "wheelhouse", env={"ANYKPL_PURE": "1"}
    )


@nox.session
def bench(session: nox.Session) -> None:
    session.install("-e", ".[bench]")
    session.run("anykpl", "bench", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    session.install("-e", ".[demo]")
    session.run("anykpl", "demo", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    session.install("mkdocs-material")
    session.run("mkdocs", "build", "--strict")
