"""The docs site stays true to the code: the generated configuration reference is current,
every field is documented, every page is in the navigation, and relative links resolve.

(``nox -s docs`` builds the site with ``mkdocs build --strict``, which checks links too; these
tests catch the same drift in the ordinary test run, without mkdocs installed.)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from anykpl import ProducerConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _generator() -> ModuleType:
    path = ROOT / "scripts" / "gen_config_reference.py"
    spec = importlib.util.spec_from_file_location("gen_config_reference", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current() -> None:
    generator = _generator()
    committed = generator.OUTPUT.read_text(encoding="utf-8")
    assert committed == generator.generate(), (
        "docs/reference/configuration.md is out of date with ProducerConfig: "
        f"run `{generator.REGENERATE}` and commit the result"
    )


def test_configuration_guide_summary_is_current() -> None:
    generator = _generator()
    guide = generator.GUIDE.read_text(encoding="utf-8")
    assert guide == generator.guide_with_summary(guide), (
        "the field summary in docs/configuration.md is out of date with ProducerConfig: "
        f"run `{generator.REGENERATE}` and commit the result"
    )


def test_every_config_field_is_documented() -> None:
    documented = _generator()._docstring_fields(ProducerConfig)
    missing = [f.name for f in dataclasses.fields(ProducerConfig) if f.name not in documented]
    assert not missing, f"add these fields to ProducerConfig's 'Attributes:' docstring: {missing}"


def _nav_pages() -> set[str]:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text[text.index("\nnav:") :]
    return set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.MULTILINE))


def test_every_page_is_in_the_nav() -> None:
    pages = {path.relative_to(DOCS).as_posix() for path in DOCS.rglob("*.md")}
    nav = _nav_pages()
    assert pages - nav == set(), "add these pages to the nav in mkdocs.yml"
    assert nav - pages == set(), "the nav in mkdocs.yml names pages that do not exist"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")))
def test_relative_links_resolve(page: str) -> None:
    path = DOCS / page
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{page} links to missing files: {broken}"


def test_the_docs_site_builds_without_warnings(tmp_path: Path) -> None:
    """``mkdocs build --strict`` (what ``nox -s docs`` runs): a broken link, a page missing from
    the nav or a bad anchor fails here."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_fleets_iam_policies_name_exactly_the_operations_the_stores_call() -> None:
    """docs/fleet.md's least-privilege policies, one per store, against the operations the
    code calls (each store counts its calls by these names)."""
    from anykpl._fleet._dynamodb_store import OPERATIONS
    from anykpl._fleet._store import KINDS

    text = (DOCS / "fleet.md").read_text()
    section = text[text.index("## IAM permissions") : text.index("## The DynamoDB table")]
    actions: set[str] = set()
    for block in re.findall(r"```json\n(.*?)```", section, re.S):
        for statement in json.loads(block)["Statement"]:
            listed = statement["Action"]
            actions.update([listed] if isinstance(listed, str) else listed)
    # S3 authorizes ListObjectsV2 as s3:ListBucket
    s3 = {"s3:" + ("ListBucket" if k == "ListObjectsV2" else k) for k in KINDS.values()}
    dynamodb = {f"dynamodb:{operation}" for operation in OPERATIONS}
    assert actions == s3 | dynamodb
