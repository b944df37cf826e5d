"""pagedserve installs one import name, `pagedserve`, whose parts are the top-level folders; in a
checkout the folders never shadow another distribution's package (Hugging Face's `kernels`)."""
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_pyproject_lists_every_package_in_the_tree():
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.parent.relative_to(ROOT / folder).parts
            if "__pycache__" not in parts:
                found.add(".".join([package, *parts]))
    assert found == set(SETUPTOOLS["packages"])


def test_the_only_top_level_import_name_is_pagedserve():
    assert {p.split(".")[0] for p in SETUPTOOLS["packages"]} == {"pagedserve"}
    assert {p.split(".")[0] for p in SETUPTOOLS["package-data"]} == {"pagedserve"}


def test_transformers_is_not_capped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = [r for r in project["dependencies"] if r.startswith("transformers")]
    assert "<" not in requirement


def test_import_kernels_in_a_checkout_is_hugging_faces():
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed")
    where = Path(_python("import kernels; print(kernels.__file__)"))
    assert where.resolve().is_relative_to(Path(dist.locate_file("")).resolve())
    assert not where.resolve().is_relative_to(ROOT / "kernels")


def test_serve_app_by_its_folder_name_is_pagedserves_module():
    assert _python("import serve_app, pagedserve.serve_app as p; "
                   "print(serve_app is p and serve_app.app is p.app)") == "True"


def test_the_offline_api_imports_from_the_package_without_torch_until_used():
    assert _python("import sys, pagedserve; from pagedserve import SamplingParams; "
                   "print('torch' in sys.modules)") == "False"
