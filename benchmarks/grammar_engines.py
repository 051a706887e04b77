"""xgrammar against llguidance, on the default model's tokenizer: the measurement behind
pagedserve's choice of grammar engine.

    python benchmarks/grammar_engines.py [--model DIR] [--repeat 5] [--json out.json]

For each engine and each schema it reports:
- `init_s`: building the engine's tokenizer view once (per model, at startup);
- `compile_ms`: turning a first-seen schema into a matcher (no cache), median of --repeat;
- `mask_us`: per generated token, filling the matcher's next-token bitmask and advancing it
  with the token, walked along a valid instance of the schema (median over the tokens);
- `apply_us`: applying a bitmask of 16 rows to (16, vocab) float32 logits on the CPU.
Whitespace between JSON tokens is disabled on both (what the server runs). An engine that
is not installed is skipped. Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested-arrays-enum": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "status": {"enum": ["draft", "published", "archived"]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
            "author": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
                "required": ["name"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "status", "tags", "author"],
        "additionalProperties": False,
    },
    "bounds-pattern": {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        },
        "required": ["sku", "price", "quantity"],
        "additionalProperties": False,
    },
    "defs-anyof": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "shape": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "string"}]},
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}},
        },
        "required": ["shape", "points"],
        "additionalProperties": False,
    },
}
INSTANCES: dict[str, Any] = {
    "flat": {"name": "Ada Lovelace", "age": 36},
    "nested-arrays-enum": {
        "title": "On the analytical engine",
        "status": "published",
        "tags": ["math", "history"],
        "author": {"name": "Ada", "email": "ada@example.com"},
    },
    "bounds-pattern": {"sku": "ABC-1234", "price": 19.5, "quantity": 3},
    "defs-anyof": {"shape": {"x": 1.5, "y": -2}, "points": [{"x": 0, "y": 0}, {"x": 3, "y": 4}]},
    "json_object": {"answer": [1, 2, {"nested": True}], "note": "any JSON object"},
}


def timed(func: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = func()
    return time.perf_counter() - start, result


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.bitmask = llguidance.torch.allocate_token_bitmask(16, vocab_size)
        self.apply = llguidance.torch.apply_token_bitmask_inplace

    def compile(self, schema: dict[str, Any] | None) -> Any:
        options = {"whitespace_flexible": False}
        spec = {"type": "object"} if schema is None else schema
        grammar = self.llg.LLMatcher.grammar_from_json_schema(spec, defaults=options)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def step(self, matcher: Any, token: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(matcher, self.bitmask, 0)
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(16, vocab_size)
        self.apply = xgrammar.apply_token_bitmask_inplace

    def compile(self, schema: dict[str, Any] | None) -> Any:
        if schema is None:
            compiled = self.compiler.compile_builtin_json_grammar()
        else:
            compiled = self.compiler.compile_json_schema(schema, any_whitespace=False)
        return self.xgr.GrammarMatcher(compiled)

    def step(self, matcher: Any, token: int) -> None:
        matcher.fill_next_token_bitmask(self.bitmask, 0)
        assert matcher.accept_token(token)


def instance_tokens(engine: Any, tokenizer: Any, name: str) -> list[int]:
    """The instance as the engine's grammar spells it (compact or with spaces after , and :)."""
    schema = SCHEMAS.get(name)
    for separators in ((",", ":"), (", ", ": ")):
        text = json.dumps(INSTANCES[name], separators=separators)
        tokens = tokenizer.encode(text, add_special_tokens=False)
        matcher = engine.compile(schema)
        try:
            for token in tokens:
                engine.step(matcher, token)
            return list(tokens)
        except AssertionError:
            continue
    raise RuntimeError(f"{engine.name} accepts neither spelling of the {name} instance")


def measure(engine_cls: type, tokenizer: Any, vocab: int, repeat: int) -> dict[str, Any]:
    init_s, engine = timed(lambda: engine_cls(tokenizer, vocab))
    result: dict[str, Any] = {"init_s": round(init_s, 3), "schemas": {}}
    for name in [*SCHEMAS, "json_object"]:
        schema = SCHEMAS.get(name)
        compile_times = [timed(lambda s=schema: engine.compile(s))[0] for _ in range(repeat)]
        tokens = instance_tokens(engine, tokenizer, name)
        per_token = []
        for _ in range(repeat):
            matcher = engine.compile(schema)
            for token in tokens:
                per_token.append(timed(lambda m=matcher, t=token: engine.step(m, t))[0])
        result["schemas"][name] = {
            "compile_ms": round(statistics.median(compile_times) * 1e3, 2),
            "mask_us": round(statistics.median(per_token) * 1e6, 1),
            "mask_p90_us": round(statistics.quantiles(per_token, n=10)[-1] * 1e6, 1),
            "tokens": len(tokens),
        }
    logits = torch.randn(16, vocab)
    apply_times = [timed(lambda: engine.apply(logits, engine.bitmask))[0] for _ in range(50)]
    result["apply_us"] = round(statistics.median(apply_times) * 1e6, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: bundled)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from engine import prepare_default_model

    model = args.model or str(prepare_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    with open(f"{model}/config.json") as f:
        vocab = json.load(f)["vocab_size"]
    torch.set_num_threads(1)
    results = {}
    for engine_cls in (XGrammar, LLGuidance):
        try:
            results[engine_cls.name] = measure(engine_cls, tokenizer, vocab, args.repeat)
        except ImportError as exc:
            print(f"{engine_cls.name}: skipped ({exc})")
    for engine, result in results.items():
        print(f"{engine}: init {result['init_s']} s, apply 16 rows {result['apply_us']} us")
        for name, r in result["schemas"].items():
            print(
                f"  {name:20s} compile {r['compile_ms']:8.2f} ms  mask+advance median "
                f"{r['mask_us']:7.1f} us (p90 {r['mask_p90_us']:7.1f}) over {r['tokens']} tokens"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
