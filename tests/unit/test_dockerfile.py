"""The runtime image, checked offline: there is no Docker engine here, so the Dockerfile is parsed
(``dockerfile_parse``) and what Flyte and KubeRay will do with the image is derived from its instructions."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import distribution
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCK = REPO_ROOT / "requirements.lock"
# Packages a Debian/Ubuntu stage installs only to compile something.
COMPILER_PACKAGES = {
    "build-essential",
    "gcc",
    "g++",
    "cpp",
    "clang",
    "make",
    "cmake",
    "ninja-build",
    "cuda-nvcc",
    "cuda-toolkit",
    "gfortran",
    "libc6-dev",
}
# Ubuntu's and NVIDIA's CUDA images are the only bases; each names an exact release in its tag.
VERSIONED_TAG = re.compile(r"^\d+(\.\d+)+(-[a-z0-9.]+)*$")
LOCK_LINE = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[A-Za-z0-9.+!_-]+)$")


@dataclass
class Stage:
    name: str
    base: str
    """The image or earlier stage this one starts FROM, with build ARGs substituted."""
    instructions: list[dict] = field(default_factory=list)

    def values(self, instruction: str) -> list[str]:
        return [i["value"] for i in self.instructions if i["instruction"] == instruction]


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    parser = DockerfileParser(str(REPO_ROOT / "Dockerfile"))
    bases = iter(parser.parent_images)
    result: list[Stage] = []
    for instruction in parser.structure:
        if instruction["instruction"] == "FROM":
            words = instruction["value"].split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(result))
            result.append(Stage(name=name, base=next(bases)))
        elif result:
            result[-1].instructions.append(instruction)
    return result


def lineage(stages: list[Stage], stage: Stage) -> list[Stage]:
    """The stage and every earlier stage it builds on, nearest first."""
    by_name = {s.name: s for s in stages}
    chain = [stage]
    while chain[-1].base in by_name:
        chain.append(by_name[chain[-1].base])
    return chain


def final_env(stages: list[Stage]) -> dict[str, str]:
    """ENV of the final stage as the container sees it (inherited stages first, later values win)."""
    env: dict[str, str] = {}
    for stage in reversed(lineage(stages, stages[-1])):
        for value in stage.values("ENV"):
            for word in shlex.split(value):
                name, _, setting = word.partition("=")
                env[name] = setting.replace("$PATH", env.get("PATH", "")).replace("${PATH}", env.get("PATH", ""))
    return env


def read_lock() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = LOCK_LINE.match(line)
        assert match, f"requirements.lock line {line!r} is not name==version"
        pins[canonicalize_name(match["name"])] = match["version"]
    return pins


def pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_every_base_image_is_pinned_to_an_exact_version(stages):
    stage_names = {s.name for s in stages}
    external = [s.base for s in stages if s.base not in stage_names]
    assert external, "no stage starts from an external image"
    for image in external:
        reference, _, digest = image.partition("@")
        repository, _, tag = reference.rpartition(":") if ":" in reference.split("/")[-1] else (reference, "", "")
        assert tag and tag != "latest", f"FROM {image}: name an exact version tag"
        assert VERSIONED_TAG.match(tag), f"FROM {image}: tag {tag!r} names no exact version"
        if digest:
            assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), f"FROM {image}: malformed digest"
    # Stages only refer back to earlier stages.
    for index, stage in enumerate(stages):
        if stage.base in stage_names:
            assert stage.base in [s.name for s in stages[:index]], f"stage {stage.name} starts from a later stage"


def test_the_final_stage_runs_as_a_numeric_non_root_user(stages):
    users = [value for stage in reversed(lineage(stages, stages[-1])) for value in stage.values("USER")]
    assert users, "the final stage never sets USER, so it runs as root"
    user = users[-1].split(":")[0]
    assert user.isdigit() and int(user) != 0, f"USER {users[-1]}: use a numeric uid other than 0"
    # HOME and TMPDIR point at directories that user can write (HOME is chowned to it in the final stage).
    env = final_env(stages)
    assert env.get("TMPDIR") == "/tmp"
    chowns = [
        shlex.split(command)
        for run in stages[-1].values("RUN")
        for command in re.split(r"&&|;", run)
        if shlex.split(command)[:1] == ["chown"]
    ]
    assert any(any(w.split(":")[0] == user for w in words) and env["HOME"] in words for words in chowns), (
        f"HOME ({env['HOME']}) is not chowned to the runtime user {user}"
    )


def test_the_builder_installs_exactly_the_committed_lock(stages):
    installs = [
        (stage, run) for stage in stages for run in stage.values("RUN") if "pip install" in run and "-r " in run
    ]
    assert len(installs) == 1, f"expected one `pip install -r` of the lock, found {len(installs)}"
    stage, run = installs[0]
    assert stage is not stages[-1], "the lock is installed in the final stage; install it in the builder"
    words = shlex.split(run.replace("\\\n", " "))
    requirement_file = words[words.index("-r") + 1]
    assert "--no-deps" in words, "pip must not resolve anything at build time: install the lock with --no-deps"
    copies = [shlex.split(value) for value in stage.values("COPY")]
    assert ["requirements.lock", requirement_file] in copies, f"no COPY brings requirements.lock to {requirement_file}"
    assert "pip check" in run, "check the installed set is consistent after installing the lock"
    # The final stage takes that environment, not another one.
    assert any(v.startswith("--from=" + stage.name) for v in stages[-1].values("COPY"))


def test_the_lock_file_holds_exact_pins_that_satisfy_pyproject():
    pins = read_lock()
    assert len(pins) > 50, "the lock should hold the whole dependency closure, not only the direct dependencies"
    for text in pyproject()["project"]["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is a runtime dependency but is not in requirements.lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {requirement.name}=={pins[name]}, outside pyproject's {requirement.specifier}; "
            "run `make venv lock`"
        )
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
    for name in ("flytekit", "flytekitplugins-ray", "ray", "mlflow"):
        assert pins[name] == distribution(name).version, f"{name} in the lock differs from the tested venv"


def test_the_lock_leaves_out_the_test_only_extras():
    pins = read_lock()
    runtime = {canonicalize_name(Requirement(t).name) for t in pyproject()["project"]["dependencies"]}
    for text in pyproject()["project"]["optional-dependencies"]["test"]:
        name = canonicalize_name(Requirement(text).name)
        # A test extra may also be a runtime dependency of something else (botocore is one of s3fs's).
        if name in {"botocore", "jsonschema"} or name in runtime:
            continue
        assert name not in pins, f"{name} is only needed by the tests but is in requirements.lock"
    assert "flyte-ray-training" not in pins, "the project itself travels as code, not as a locked package"


def test_no_compiler_reaches_the_final_stage(stages):
    for stage in lineage(stages, stages[-1]):
        for run in stage.values("RUN"):
            for command in re.split(r"&&|;|\|\|", run):
                words = shlex.split(command.replace("\\\n", " "))
                if "install" in words and any(w in ("apt-get", "apt", "apk", "yum", "dnf") for w in words):
                    packages = {w for w in words[words.index("install") + 1 :] if not w.startswith("-")}
                    compilers = {p for p in packages if p in COMPILER_PACKAGES or p.endswith("-dev")}
                    assert not compilers, f"stage {stage.name} (under the final stage) installs {sorted(compilers)}"


def test_every_container_of_the_image_gets_the_platforms_ray_settings(stages):
    """Ray pods the platform did not size (the kustomize examples, a user's own RayCluster on this image) start Ray
    with the same settings as the platform's RayJobs."""
    from training_core.parallel.ray_settings import PROCESS_ENV

    env = final_env(stages)
    assert {name: env.get(name) for name in PROCESS_ENV} == PROCESS_ENV


def test_pyflyte_execute_resolves_the_train_task_in_the_final_stage(stages):
    from flytekit.configuration import DEFAULT_IN_CONTAINER_SRC_PATH, DEFAULT_RUNTIME_PYTHON_INTERPRETER

    env = final_env(stages)
    venv_bin = str(Path(DEFAULT_RUNTIME_PYTHON_INTERPRETER).parent)
    assert env["PATH"].split(":")[0] == venv_bin, f"{venv_bin} must lead PATH: pyflyte-execute and ray live there"
    venv = str(Path(venv_bin).parent)
    assert any(shlex.split(v)[-2:] == [venv, venv] for v in stages[-1].values("COPY") if v.startswith("--from="))
    # flytekit and ray, both in the lock, provide the commands Flyte and KubeRay run.
    scripts = {
        e.name for name in ("flytekit", "ray") for e in distribution(name).entry_points if e.group == "console_scripts"
    }
    assert {"pyflyte-execute", "pyflyte-fast-execute", "ray"} <= scripts
    # `--resolver ... -- task-module tasks.train task-name train` imports tasks.train: the code sits in flytekit's
    # in-container source path (where `--copy all` unpacks it too), which is on PYTHONPATH.
    assert DEFAULT_IN_CONTAINER_SRC_PATH in env["PYTHONPATH"].split(":")
    assert stages[-1].values("WORKDIR")[-1] == DEFAULT_IN_CONTAINER_SRC_PATH
    copied = {shlex.split(v)[-1] for v in stages[-1].values("COPY") if not v.startswith("--from=")}
    # examples/: user code that configs name by import path (examples/tabular_mlp.yaml) imports from /root too.
    for package in ("tasks", "workflows", "training_core", "examples"):
        assert f"{DEFAULT_IN_CONTAINER_SRC_PATH}/{package}" in copied, f"{package}/ is not copied into the image"
    assert (REPO_ROOT / "tasks" / "train.py").exists()


def test_entrypoint_passes_flyte_and_kuberay_commands_through(stages):
    # Flyte sets only the container's args (flytekit serializes `command=[]`), so they replace CMD and run
    # after ENTRYPOINT; KubeRay sets `command`, which replaces ENTRYPOINT. Either way ENTRYPOINT must exec its
    # arguments unchanged.
    entrypoints = [v for stage in reversed(lineage(stages, stages[-1])) for v in stage.values("ENTRYPOINT")]
    flyte_args = [
        "pyflyte-execute",
        "--inputs",
        "s3://b/inputs.pb",
        "--resolver",
        "r",
        "--",
        "task-module",
        "tasks.train",
        "task-name",
        "train",
    ]
    if entrypoints:
        entrypoint = json.loads(entrypoints[-1])
        assert isinstance(entrypoint, list), "use the exec form, so no shell rewrites Flyte's arguments"
        assert Path(entrypoint[0]).name in {"tini", "dumb-init"} and entrypoint[-1] == "--", (
            f"ENTRYPOINT {entrypoint} does not hand its arguments to a command"
        )
        argv = entrypoint + flyte_args
        assert argv[argv.index("--") + 1 :] == flyte_args
        # tini must be in the image: installed in a stage the final stage builds on.
        installs = " ".join(run for stage in lineage(stages, stages[-1]) for run in stage.values("RUN"))
        assert Path(entrypoint[0]).name in installs
    cmd = json.loads(stages[-1].values("CMD")[-1]) if stages[-1].values("CMD") else []
    assert "pyflyte-execute" not in cmd and "ray" not in cmd, "CMD is a default shell, never a fixed job"


def test_one_image_setting_reaches_the_build_and_the_package():
    image = "registry.example.com/ml/flyte-ray-training:abc123"
    for target in ("image", "package"):
        dry_run = subprocess.run(
            ["make", "-n", target, f"IMAGE={image}"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout
        assert image in dry_run, f"`make {target} IMAGE=...` does not use IMAGE"


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    patterns = {
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    for local in (".venv", ".git", "mlruns", "*.db", "**/__pycache__", ".pytest_cache", "tests"):
        assert local in patterns, f".dockerignore does not exclude {local}"
    for needed in ("requirements.lock", "tasks", "workflows", "training_core", "examples"):
        assert needed not in patterns
