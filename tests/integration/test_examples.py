"""Every script in ``examples/`` runs against the emulator and passes its own check.

Each example reads the stream back at the end and exits 0 only when every record it was told
was stored is there; this test runs it in a fresh interpreter (as a user would, with warnings
as errors) against the ``kinesis_emulator`` fixture that anykpl gives its users' tests
(``anykpl.testing``), and reads the stream back through the fixture as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from anykpl.testing import KinesisEmulator

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

#: example -> arguments that keep it short (what they import is in the ``test`` extra)
CASES: dict[str, list[str]] = {
    "quickstart.py": ["--records", "2000"],
    "fastapi_service.py": ["--requests", "100", "--batch", "200"],
    "trio_service.py": ["--clients", "4", "--lines", "200"],
    "iot_ingestion.py": ["--devices", "300", "--interval", "0.5", "--duration", "2"],
    "flask_sync.py": ["--requests", "200", "--threads", "8"],
    "prometheus_metrics.py": ["--seconds", "2"],
    "lambda_consumer.py": ["--readings", "2000", "--batch", "3"],
}

#: examples not run here yet, and why (each should take --endpoint and check its own results)
NOT_RUN_YET: dict[str, str] = {}


def test_every_example_is_run() -> None:
    scripts = {path.name for path in EXAMPLES.glob("*.py") if not path.name.startswith("_")}
    assert scripts - set(NOT_RUN_YET) == set(CASES), "add new examples to CASES in this file"


@pytest.mark.parametrize("name", sorted(CASES))
def test_example(name: str, kinesis_emulator: KinesisEmulator, tmp_path: Path) -> None:
    arguments = CASES[name]
    stream = None
    if name != "quickstart.py":  # quickstart makes a stream of its own
        stream = f"example-{uuid.uuid4().hex[:8]}"
        arguments = [*arguments, "--stream", stream]
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("AWS_", "ANYKPL_", "BOTO"))
    }
    env.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE=str(tmp_path / "config"),
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"),
    )
    completed = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            str(EXAMPLES / name),
            "--endpoint",
            kinesis_emulator.endpoint_url,
            *arguments,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert "missing" in output  # every example reports its read-back
    if stream is not None:
        assert kinesis_emulator.records(stream), "nothing in the stream the example wrote to"
