"""The container images and the KubeRay config agree with the tree and with the README (the
images themselves are built where Docker runs, not here)."""
from __future__ import annotations

import importlib
import re
import shlex

import pytest
import yaml

from tests.serve.conftest import REPO

DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]
README = (REPO / "README.md").read_text()
PYPROJECT = (REPO / "pyproject.toml").read_text()
VERSION = re.search(r'^version = "([^"]+)"', PYPROJECT, re.M)[1]
RAY_FLOOR = re.search(r'"ray\[serve\]>=([\d.]+)"', PYPROJECT)[1]  # the oldest release declared


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (REPO / name).read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def pip_commands(shell: str) -> list[list[str]]:
    """Each `pip install ...` of a shell line, without -e (images install, not editable)."""
    commands = []
    for part in shell.split("&&"):
        words = shlex.split(part)
        if words[:2] == ["pip", "install"]:
            commands.append([w for w in words if w != "-e"])
    return commands


def readme_setup_pip_commands() -> list[list[str]]:
    first_command = next(line for line in README.splitlines() if line.startswith("python3 -m venv"))
    return pip_commands(first_command)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_file_a_dockerfile_copies_exists(name):
    copies = [args for kind, args in instructions(name) if kind == "COPY"]
    assert copies
    for args in copies:
        sources = [w for w in shlex.split(args) if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"{name} copies {source}, which is not in the tree"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_as_the_readme_does(name):
    (run,) = [args for kind, args in instructions(name) if kind == "RUN" and "pip install" in args]
    expected = readme_setup_pip_commands()
    if name.endswith(".gpu"):  # the README: "on a GPU machine leave -c constraints.txt out"
        expected = [[w for w in cmd if w not in ("-c", "constraints.txt")] for cmd in expected]
    assert pip_commands(run) == expected


def test_images_and_the_cluster_run_one_ray_release_the_project_allows():
    versions = set()
    for name, suffix in (("Dockerfile", "cpu"), ("Dockerfile.gpu", "gpu")):
        (base,) = [args for kind, args in instructions(name) if kind == "FROM"]
        version = re.fullmatch(rf"rayproject/ray:([\d.]+)-py311-{suffix}", base)[1]
        versions.add(version)
    cluster = yaml.safe_load((REPO / "cluster.yaml").read_text())
    versions.add(cluster["spec"]["rayClusterConfig"]["rayVersion"])
    (version,) = versions
    as_tuple = lambda v: tuple(map(int, v.split(".")))  # noqa: E731
    assert as_tuple(version) >= as_tuple(RAY_FLOOR)


def readme_image_tags() -> dict[str, str]:
    """Dockerfile -> the tag the README's `docker build` command gives it."""
    tags = {}
    for line in README.splitlines():
        if line.startswith("docker build"):
            words = shlex.split(line.split("#")[0])
            dockerfile = words[words.index("-f") + 1] if "-f" in words else "Dockerfile"
            tags[dockerfile] = words[words.index("-t") + 1]
    return tags


def uncommented_gpu_group(text: str) -> str:
    """cluster.yaml with its commented GPU worker group uncommented, as its comment says."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# - groupName: gpu-replicas")
    indent = lines[start].index("#")
    return "\n".join(lines[:start] + [line[:indent] + line[indent + 2:] for line in lines[start:]])


def test_cluster_yaml_runs_the_images_the_readme_builds():
    tags = readme_image_tags()
    assert tags == {"Dockerfile": f"pagedserve:{VERSION}", "Dockerfile.gpu": f"pagedserve-gpu:{VERSION}"}
    text = (REPO / "cluster.yaml").read_text()
    spec = yaml.safe_load(uncommented_gpu_group(text))["spec"]["rayClusterConfig"]
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    groups = {g["groupName"]: g["template"]["spec"]["containers"][0]
              for g in spec["workerGroupSpecs"]}
    assert head["image"] == groups["cpu-replicas"]["image"] == tags["Dockerfile"]
    assert groups["gpu-replicas"]["image"] == tags["Dockerfile.gpu"]
    assert groups["gpu-replicas"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert len(yaml.safe_load(text)["spec"]["rayClusterConfig"]["workerGroupSpecs"]) == 1


def test_the_serve_config_in_cluster_yaml_builds():
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    serve_config = yaml.safe_load(yaml.safe_load((REPO / "cluster.yaml").read_text())
                                  ["spec"]["serveConfigV2"])
    (application,) = ServeDeploySchema.model_validate(serve_config).applications
    module, _, name = application.import_path.partition(":")
    builder = getattr(importlib.import_module(module), name)  # an app builder: it takes the args
    assert isinstance(builder(application.args), Application)


def test_the_head_pod_is_ready_when_the_app_generates():
    from pagedserve.serve_app.http import OPEN_PATHS
    head = yaml.safe_load((REPO / "cluster.yaml").read_text())["spec"]["rayClusterConfig"][
        "headGroupSpec"]["template"]["spec"]["containers"][0]
    probe = head["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health/ready" and probe["path"] in OPEN_PATHS  # no key needed
    assert "livenessProbe" not in head  # restarting the head would take the cluster down
