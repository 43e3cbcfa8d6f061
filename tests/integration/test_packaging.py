"""The release check: ``python -m build`` makes an sdist and a wheel that ``twine check`` passes,
with one version, the metadata a package index shows, and the entry points; the sdist carries
the tests and docs; and the wheel, installed with its extras into a clean virtual environment,
runs the quickstart and the ``kinesis_emulator`` fixture there. The wheel built here is the pure
one (``ANYKPL_PURE=1``: compiling takes a minute, and this suite must stay fast); .ci/run
installs the compiled build that ``pip install .`` gives, runs the fast suite against it,
checks that it left nothing compiled in the work tree, and checks the fallback to the pure
wheel when the C compiler fails (hatch_build.py).

Slow (builds and an install from the package index, with pip's cache), so it builds once per
session of this module."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import anykpl

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def _run(*command: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None) -> str:
    completed = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    return output


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "ANYKPL_PURE": "1"}
    output = _run(sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", out, env=env)
    assert "ANYKPL_PURE is set, pure Python" in output, output
    return out


def _one(dist: Path, pattern: str) -> Path:
    (path,) = dist.glob(pattern)
    return path


def test_twine_check_passes(dist: Path) -> None:
    output = _run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))
    assert output.count("PASSED") == 2, output


def test_the_wheel_s_metadata(dist: Path) -> None:
    wheel = _one(dist, "anykpl-*.whl")
    assert wheel.name == f"anykpl-{anykpl.__version__}-py3-none-any.whl", wheel.name
    with zipfile.ZipFile(wheel) as archive:
        info = f"anykpl-{anykpl.__version__}.dist-info"
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        names = archive.namelist()
    assert metadata["Version"] == anykpl.__version__
    assert metadata["Requires-Python"] == ">=3.10"
    assert metadata["License-Expression"] == "Apache-2.0"
    classifiers = metadata.get_all("Classifier")
    for version in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Repository", "Issues", "Changelog"} <= set(urls)
    assert metadata["Description-Content-Type"] == "text/markdown"
    assert "anykpl = anykpl._commands.cli:main" in entry_points
    assert "[pytest11]" in entry_points
    assert "anykpl = anykpl.testing" in entry_points
    assert f"{info}/licenses/LICENSE" in names
    assert "anykpl/py.typed" in names
    # pure: nothing compiled
    assert not [name for name in names if name.endswith((".so", ".pyd"))]
    assert not [name for name in names if name.startswith(("tests/", "docs/"))]


def test_the_sdist_carries_tests_docs_and_examples(dist: Path) -> None:
    sdist = _one(dist, "anykpl-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in (
        "pyproject.toml",
        "README.md",
        "CHANGELOG.md",
        "LICENSE",
        "mkdocs.yml",
        "src/anykpl/__init__.py",
        "tests/conftest.py",
        "tests/integration/test_end_to_end.py",
        "docs/index.md",
        "docs/recipes/testing.md",
        "examples/quickstart.py",
        "scripts/gen_config_reference.py",
    ):
        assert needed in names, needed
    assert not [name for name in names if name.startswith((".venv/", ".git/"))]


def test_the_wheel_in_a_clean_venv_runs_the_quickstart_and_the_fixture(
    dist: Path, tmp_path: Path
) -> None:
    environment = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(environment)
    python = environment / "bin" / "python"
    wheel = _one(dist, "anykpl-*.whl")
    _run(python, "-m", "pip", "install", "--quiet", f"{wheel}[emulator,trio]", "pytest", "anyio")
    clean = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AWS_", "ANYKPL_", "PYTHON", "VIRTUAL_ENV"))
    }
    # installed, not this checkout: run from elsewhere, with the version the wheel has
    version = _run(environment / "bin" / "anykpl", "--version", cwd=tmp_path, env=clean)
    assert version.strip() == f"anykpl {anykpl.__version__} (pure Python)"
    imported = _run(python, "-c", "import anykpl; print(anykpl.__file__)", cwd=tmp_path, env=clean)
    assert str(environment) in imported

    quickstart = ROOT / "examples" / "quickstart.py"
    output = _run(python, "-W", "error", quickstart, "--records", "2000", cwd=tmp_path, env=clean)
    assert ": 0 missing" in output, output

    (tmp_path / "test_user.py").write_text(
        "from anykpl import SyncProducer\n\n\n"
        "def test_it(kinesis_emulator):\n"
        "    stream = kinesis_emulator.create_stream('s')\n"
        "    with SyncProducer(kinesis_emulator.producer_config()) as producer:\n"
        "        producer.put_record(stream, b'x', partition_key='k')\n"
        "    assert kinesis_emulator.data(stream) == [b'x']\n"
    )
    output = _run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=tmp_path, env=clean)
    assert "1 passed" in output, output
