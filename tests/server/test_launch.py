"""`pagedserve serve` (server.launch) starts the engine core's interpreter before it reads
its flags: the core then serves as one started later does, and a command that ends before
using it leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from server.launch import prestart_worthwhile
from tests.server.live import ServerProcess

TINY_ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256"]


@pytest.mark.parametrize(
    ("argv", "environ", "worthwhile"),
    [
        (["serve"], {}, True),
        (["serve", "/models/x", "--port", "9000"], {}, True),
        (["info"], {}, False),
        (["prepare-default-model"], {}, False),
        ([], {}, False),
        (["serve", "--engine-in-process"], {}, False),
        (["serve", "--engine-in-proc"], {}, False),  # argparse takes a prefix
        (["serve", "--api-server-count", "2"], {}, False),
        (["serve", "--api-server-count=1"], {}, False),  # not parsed here: no guess
        (["serve", "--help"], {}, False),
        (["serve", "-h"], {}, False),
        (["serve"], {"PAGEDSERVE_ENGINE_IN_PROCESS": "true"}, False),
        (["serve"], {"PAGEDSERVE_ENGINE_IN_PROCESS": " Yes "}, False),
        (["serve"], {"PAGEDSERVE_ENGINE_IN_PROCESS": "false"}, True),
        (["serve"], {"PAGEDSERVE_API_SERVER_COUNT": "3"}, False),
        (["serve"], {"PAGEDSERVE_API_SERVER_COUNT": "1"}, True),
    ],
)
def test_when_a_core_is_started_before_the_flags(
    argv: list[str], environ: dict[str, str], worthwhile: bool
) -> None:
    assert prestart_worthwhile(argv, environ) is worthwhile


def test_the_entry_point_serves_on_the_core_it_started_first(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    args = [str(tiny_model_dir), *TINY_ARGS, "--served-model-name", "tiny"]
    with ServerProcess(args, log=log) as server:
        body = {"model": "tiny", "prompt": [5, 9, 30], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8
    assert "started before the flags were read" in log.read_text()


def tagged_processes(tag: str) -> list[int]:
    """The processes whose environment holds TEST_TAG=tag."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:  # gone, or not ours to read
                continue
            if f"TEST_TAG={tag}".encode() in environ.split(b"\0"):
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize(
    "extra",
    [["--max-long-partial-prefills", "3"], ["--no-such-flag"]],
    ids=["a value serve refuses", "a flag argparse refuses"],
)
def test_a_serve_that_exits_early_ends_its_prestarted_core(
    tmp_path: Path, extra: list[str]
) -> None:
    tag = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "server.launch", "serve", str(tmp_path / "missing"), *extra]
    env = {**os.environ, "TEST_TAG": tag}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    deadline = time.monotonic() + 10
    while tagged_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_processes(tag) == []


def test_in_process_flags_from_a_config_the_words_missed_end_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An engine in process that the command line did not show (here a flag written as
    an unambiguous prefix the launcher does not know) still ends the prestarted core."""
    tag = uuid.uuid4().hex
    log = tmp_path / "server.log"
    args = [str(tiny_model_dir), *TINY_ARGS, "--engine-i"]
    with ServerProcess(args, env={"TEST_TAG": tag}, log=log) as server:
        assert server.proc is not None
        deadline = time.monotonic() + 10
        while len(tagged_processes(tag)) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tagged_processes(tag) == [server.proc.pid]  # the server alone
    assert "started before the flags were read" not in log.read_text()
