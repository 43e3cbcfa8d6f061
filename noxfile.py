"""Developer sessions: ``nox -s tests lint typecheck``; ``nox -s bench``; ``nox -s demo``."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("pytest", *session.posargs)


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
