"""Which part of pagedserve may import which (docs/architecture.md), read from the source: every
import a module makes, those inside functions too."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"serve_app": "pagedserve.serve_app", "replicas": "pagedserve.replicas",
           "kernels": "pagedserve.kernels"}
P = "pagedserve.replicas."
ENGINE_SIDE = [P + "engine", P + "execution", P + "models", P + "parallel", P + "quant",
               P + "structured", P + "deployment", P + "llm", P + "lora"]

# module prefix -> import prefixes it must not make
FORBIDDEN = {
    "pagedserve.kernels": ["pagedserve.replicas", "pagedserve.serve_app", "ray"],
    # The control plane: requests, scheduler, KV blocks, the records that leave the core.
    P + "core": ["torch", "ray", "numpy", "transformers", "pagedserve.kernels", *ENGINE_SIDE],
    "pagedserve.replicas": ["pagedserve.serve_app"],
    "pagedserve.serve_app": ["torch", "pagedserve.kernels", P + "execution", P + "models",
                             P + "parallel", P + "quant", P + "llm"],
}
# Only the Ray deployment shim, in the replicas, imports ray.
RAY_ALLOWED = ["pagedserve.serve_app", P + "deployment"]


def modules():
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join([package, *parts]).removesuffix(".__init__")
            yield name, path


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("name,path", list(modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_a_module_imports_only_what_its_layer_may(name, path):
    made = imports(path)
    bad = sorted(i for prefix, forbidden in FORBIDDEN.items() if under(name, prefix)
                 for i in made for f in forbidden if under(i, f))
    if not any(under(name, allowed) for allowed in RAY_ALLOWED):
        bad += sorted(i for i in made if under(i, "ray"))
    assert not bad, f"{name} imports {bad}"


def test_the_parts_have_no_top_level_name_of_their_own():
    """In a checkout the folders are namespace portions, so that a regular package of the same
    name elsewhere on sys.path (Hugging Face's `kernels`) wins over them."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not (ROOT / "replicas" / "__init__.py").exists()
