"""README.md's table of architectures is what the code does: its rows are the architectures
the engine accepts, and each yes/no is what the code that refuses a combination says (or,
for prefix caching, what a tiny model of the architecture does in the engine).

docs/models.md's table of model types lists the same architectures.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineArgs, SamplingParams
from engine.config import QuantConfig
from engine.models.arch import ARCHITECTURES, ModelArch
from engine.models.loader import check_weights
from engine.models.parallel import check_shardable
from engine.worker.worker import cuda_graph_plan
from tests.engine.test_correctness import make_prompts
from tests.tiny_models import make_config, make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
FEATURES = ("tensor parallel", "int8", "int4", "GGUF", "CUDA graphs", "prefix caching")


def readme_table(markdown: str) -> dict[str, dict[str, bool]]:
    """{architecture: {feature: supported}} from the table whose header starts
    `| architecture |`; raises ValueError for a malformed table or a cell not yes/no."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    start = next(i for i, line in enumerate(lines) if line.startswith("| architecture |"))
    header = _cells(lines[start])
    if header[2:] != list(FEATURES):
        raise ValueError(f"the table's features are {header[2:]}, expected {list(FEATURES)}")
    table = {}
    for line in lines[start + 2 :]:
        cells = _cells(line)
        if len(cells) != len(header) or not re.fullmatch(r"`\w+`", cells[0]):
            break
        if any(cell not in ("yes", "no") for cell in cells[2:]):
            raise ValueError(f"{cells[0]}: every feature is yes or no, got {cells[2:]}")
        table[cells[0].strip("`")] = {
            f: c == "yes" for f, c in zip(FEATURES, cells[2:], strict=True)
        }
    return table


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def refuses(check: Callable[[], object]) -> bool:
    try:
        check()
    except ValueError:
        return True
    return False


def static_support(arch: ModelArch) -> dict[str, bool]:
    """What the load-time checks allow for `arch`: every feature but prefix caching."""
    args = EngineArgs(model="unused")
    sizes, _ = cuda_graph_plan(args, torch.device("cuda"), "flashinfer", arch)
    return {
        "tensor parallel": not refuses(lambda: check_shardable(arch, 2)),
        "int8": not refuses(lambda: check_weights(arch, QuantConfig("int8"), use_gguf=False)),
        "int4": not refuses(lambda: check_weights(arch, QuantConfig("int4"), use_gguf=False)),
        "GGUF": not refuses(lambda: check_weights(arch, QuantConfig("gguf"), use_gguf=True)),
        "CUDA graphs": bool(sizes),
    }


def serves_from_the_prefix_cache(path: Path) -> bool:
    """Whether a second request with the first one's two full blocks reuses them."""
    llm = LLM(str(path), dtype="float32", block_size=16, num_kv_blocks=16, max_model_len=64)
    prompt = make_prompts(0, [2 * 16 + 3])[0]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([prompt], params)
    return llm.generate([prompt], params)[0].num_cached_tokens == 2 * 16


def mismatches(table: dict[str, dict[str, bool]], actual: dict[str, dict[str, bool]]) -> list:
    return [
        (name, feature, claimed, actual[name][feature])
        for name, claims in table.items()
        for feature, claimed in claims.items()
        if feature in actual[name] and claimed != actual[name][feature]
    ]


@pytest.fixture(scope="module")
def table() -> dict[str, dict[str, bool]]:
    return readme_table((ROOT / "README.md").read_text())


@pytest.fixture(scope="module")
def archs() -> dict[str, ModelArch]:
    return {
        name: ModelArch.from_hf_config(make_config(kind)) for name, kind in ARCHITECTURES.items()
    }


def test_the_rows_are_the_architectures_the_engine_accepts(table) -> None:
    """And each is transformers' class of that model type, which ModelArch accepts."""
    import transformers

    assert list(table) == list(ARCHITECTURES)
    for name, model_type in ARCHITECTURES.items():
        assert getattr(transformers, name).config_class.model_type == model_type
        assert ModelArch.from_hf_config(make_config(model_type)).model_type == model_type


def test_docs_models_lists_the_same_model_types() -> None:
    page = (ROOT / "docs" / "models.md").read_text()
    section = page.split("\n## Architectures\n")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    assert rows[0] == "model_type"  # the header
    assert rows[1:] == list(ARCHITECTURES.values())


def test_each_claim_is_what_the_load_time_checks_allow(table, archs) -> None:
    actual = {name: static_support(arch) for name, arch in archs.items()}
    assert {*actual["LlamaForCausalLM"], "prefix caching"} == set(FEATURES)
    assert mismatches(table, actual) == []


def test_prefix_caching_claims(table, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each architecture's tiny model, run in the engine with caching on."""
    actual = {}
    for name, kind in ARCHITECTURES.items():
        path = make_tiny_model(kind, tmp_path_factory.mktemp(kind))
        actual[name] = {"prefix caching": serves_from_the_prefix_cache(path)}
    assert mismatches(table, actual) == []


def test_a_wrong_cell_or_row_fails(table, archs) -> None:
    """The checks notice a flipped claim, a missing row and a cell that is not yes/no."""
    actual = {name: static_support(arch) for name, arch in archs.items()}
    wrong = {name: dict(claims) for name, claims in table.items()}
    wrong["Phi3ForCausalLM"]["GGUF"] = True
    wrong["MixtralForCausalLM"]["tensor parallel"] = True
    assert mismatches(wrong, actual) == [
        ("MixtralForCausalLM", "tensor parallel", True, False),
        ("Phi3ForCausalLM", "GGUF", True, False),
    ]
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `Phi3ForCausalLM`"))
    assert list(readme_table(readme.replace(row + "\n", ""))) != list(ARCHITECTURES)
    with pytest.raises(ValueError, match="yes or no"):
        readme_table(readme.replace(row, row.replace("| no |", "| maybe |")))
