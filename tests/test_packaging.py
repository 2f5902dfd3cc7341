"""The wheel carries the per-architecture patches and shipped checkpoints, not only the checkout."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build a wheel")
def test_wheel_contains_patches_and_checkpoint_package(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("early_exit_router-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for patch in (ROOT / "patches").glob("*.json"):
        assert f"early_exit_router/patches/{patch.name}" in names
    assert "early_exit_router/checkpoints/__init__.py" in names
    for shipped in (ROOT / "checkpoints").glob("*/*"):
        assert f"early_exit_router/checkpoints/{shipped.parent.name}/{shipped.name}" in names
    assert not any(n.startswith(("patches/", "checkpoints/", "tests/")) for n in names)


def test_no_family_needs_a_spec_file(tmp_path):
    """Discovery serves every family; the override mechanism still reads a spec file when one is there."""
    from early_exit_router.models import architecture

    assert architecture.architecture_table() == {}
    spec = {"family": "custom", "model_types": ["custom"], "layers": "model.layers", "embed_tokens": "model.e"}
    spec.update(final_norm="model.norm", lm_head="lm_head")
    (tmp_path / "custom.json").write_text(json.dumps(spec))
    original = architecture._patch_files
    architecture.architecture_table.cache_clear()
    try:
        architecture._patch_files = lambda: [(p.name, p.read_text()) for p in tmp_path.glob("*.json")]
        assert architecture.architecture_table()["custom"].layers == "model.layers"
    finally:
        architecture._patch_files = original
        architecture.architecture_table.cache_clear()


def test_the_oldest_tested_transformers_is_the_declared_floor():
    """quickstart.sh test-oldest (CI's third step) pins the release pyproject.toml's range starts at."""
    import re
    from pathlib import Path

    from early_exit_router.models._compat import MIN_TRANSFORMERS

    root = Path(__file__).resolve().parent.parent
    floor = re.search(r'"transformers>=([\d.]+),', (root / "pyproject.toml").read_text()).group(1)
    pinned = re.search(r'OLDEST_TRANSFORMERS="([\d.]+)"', (root / "quickstart.sh").read_text()).group(1)
    assert pinned == MIN_TRANSFORMERS and pinned.startswith(floor)
