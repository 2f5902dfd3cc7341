"""The documents stay true to the repository: every path they name exists, the configuration reference is the one
the code generates, and no file speaks of how the project's work was organised."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from early_exit_router.cli.config_reference import reference

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "checkpoints" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
TOP_LEVEL = ("early_exit_router/", "docs/", "checkpoints/", "examples/", "tests/", "patches/", ".ci/")
TOP_FILES = ("quickstart.sh", "pyproject.toml", "README.md", "CHANGELOG.md")


def named_paths(document: Path) -> list[tuple[str, Path]]:
    """(as written, resolved) for every repository path a document names in backticks or as a link target."""
    text = document.read_text()
    found = []
    for name in re.findall(r"`([^`\s]+)`", text):
        name = name.rstrip(".,:;)")
        if name.startswith(TOP_LEVEL) or name in TOP_FILES:
            found.append((name, ROOT / name.split("#")[0].split("::")[0]))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" not in target and not target.startswith("#"):
            found.append((target, document.parent / target.split("#")[0]))
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_document_names_exists(document):
    missing = [name for name, path in named_paths(document) if not (path.exists() or _matches_glob(path))]
    assert not missing, f"{document.relative_to(ROOT)} names paths that do not exist: {missing}"
    assert named_paths(document) or document.name == "CHANGELOG.md"  # the check has something to check


def _matches_glob(path: Path) -> bool:
    """A named pattern (`docs/bench-*/`) matches at least one path."""
    relative = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return "*" in str(relative) and any(ROOT.glob(str(relative).rstrip("/")))


def test_the_configuration_reference_is_generated_from_the_code():
    assert (ROOT / "docs" / "configuration.md").read_text() == reference(), (
        "docs/configuration.md is stale: python -m early_exit_router.cli.config_reference > docs/configuration.md"
    )


def test_no_file_speaks_of_development_sessions():
    files = [p for p in (ROOT / "early_exit_router").rglob("*.py")]
    files += [*(ROOT / "tests").glob("*.py"), *(ROOT / "examples").glob("*"), *DOCUMENTS]
    files += [*(ROOT / "checkpoints").rglob("*.json"), ROOT / "quickstart.sh", ROOT / "pyproject.toml"]
    word = re.compile(r"\bsessions?\b|session[-_ ]?\d", re.IGNORECASE)
    this_file = Path(__file__).resolve()
    offenders = [
        str(p.relative_to(ROOT)) for p in files if p.is_file() and p != this_file and word.search(p.read_text())
    ]
    assert not offenders, f"these files speak of development sessions: {offenders}"


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 260
