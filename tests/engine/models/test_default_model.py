"""The bundled default model: the CLI converts it once, and transformers can run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def run_prepare() -> list[str]:
    cmd = [sys.executable, "-m", "server.cli", "prepare-default-model"]
    result = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
    return result.stdout.strip().splitlines()


@pytest.mark.slow
def test_cli_prints_directory_and_is_idempotent(default_model_dir: Path) -> None:
    first = run_prepare()
    mtime = (default_model_dir / "model.safetensors").stat().st_mtime
    second = run_prepare()
    assert first[-1] == second[-1] == str(default_model_dir)
    assert (default_model_dir / "model.safetensors").stat().st_mtime == mtime
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (default_model_dir / name).exists(), name


@pytest.mark.slow
def test_transformers_loads_and_greedy_decodes_sensibly(default_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    input_ids = ids["input_ids"]
    out = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


def test_concurrent_preparations_take_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second caller waits for the lock, then finds the directory prepared by the first
    (here, the test) instead of converting it again over the first one's files."""
    import fcntl
    import threading

    from engine.models import default_model

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    conversions: list[Path] = []
    monkeypatch.setattr(default_model, "_prepare", conversions.append)
    target = default_model.default_model_dir()
    target.mkdir(parents=True)
    results: list[Path] = []
    with open(default_model.lock_file(target), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(
            target=lambda: results.append(default_model.prepare_default_model())
        )
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive(), "prepare_default_model did not wait for the lock"
        (target / default_model._DONE_MARKER).write_text("")
        (target / default_model.GGUF_FILENAME).write_bytes(b"")
    waiter.join(timeout=10)
    assert results == [target] and conversions == []


def test_the_gguf_file_alone_brings_its_chat_template(default_model_dir: Path) -> None:
    """Served as a bare .gguf file, the tokenizer carries the chat template the file holds
    (transformers' GGUF tokenizer leaves it out), and renders what the directory's does."""
    from engine.config import EngineArgs, load_tokenizer, resolve_model_config
    from engine.models.default_model import GGUF_FILENAME

    bare = resolve_model_config(EngineArgs(model=str(default_model_dir / GGUF_FILENAME)))
    folder = resolve_model_config(EngineArgs(model=str(default_model_dir)))
    assert bare.gguf_file == GGUF_FILENAME and folder.gguf_file is None
    from_file, from_folder = load_tokenizer(bare), load_tokenizer(folder)
    assert from_file.chat_template == (default_model_dir / "chat_template.jinja").read_text()
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    rendered = [
        t.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        for t in (from_file, from_folder)
    ]
    assert rendered[0] == rendered[1]
