"""The documentation site (mkdocs.yml, docs/) builds with no warning: every page in the nav,
every link and anchor resolving."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_docs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # the theme's banner, not a warning
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
