"""The offline API: `LLM(...).generate(prompts, params)`, shaped like vLLM's.

A synchronous face over the same machinery as AsyncLLM: EngineCore steps, and the
OutputProcessor for the `n` fan-out, detokenization and stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from engine.config import EngineArgs, EngineHooks
from engine.core import EngineCore
from engine.lora.request import LoRARequest
from engine.output_processor import EMBEDDING_PARAMS, OutputProcessor
from engine.outputs import RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams

# A text, token ids, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": text} or
# {"prompt_token_ids": ids}).
Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = {"prompt", "prompt_token_ids"}


class LLM:
    """Runs the engine in-process. `model=None` means the bundled default model; keyword
    arguments are EngineArgs fields."""

    def __init__(
        self, model: str | None = None, hooks: EngineHooks | None = None, **kwargs: Any
    ) -> None:
        self.core = EngineCore.from_args(EngineArgs(model=model, **kwargs), hooks)
        self.config = self.core.config
        self.tokenizer = self.core.tokenizer
        self._processor = OutputProcessor(self.tokenizer, self.config.model.arch.eos_token_ids)
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order. With
        `lora_request` (one for all prompts, or one per prompt, None for the base model),
        the prompts run with those LoRA adapters (an engine made with enable_lora=True)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompt_list):
                raise ValueError(f"{len(loras)} lora requests for {len(prompt_list)} prompts")
        for lora in {lora for lora in loras if lora is not None}:
            self.core.add_lora(lora)
        self._compile_constraints(params_list)
        order = [
            self._add(prompt, replace(params, output_kind=RequestOutputKind.FINAL_ONLY), lora=lora)
            for prompt, params, lora in zip(prompt_list, params_list, loras, strict=True)
        ]
        return self._run(order, "Generating", use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """An embedding engine's generate (--task embed): each output's `embedding` is its
        prompt's, in input order."""
        params = pooling_params or PoolingParams()
        order = [self._add(p, EMBEDDING_PARAMS, params) for p in _as_prompt_list(prompts)]
        return self._run(order, "Embedding", use_tqdm)

    def _add(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        pooling: PoolingParams | None = None,
        lora: LoRARequest | None = None,
    ) -> str:
        """Queues one prompt's engine requests; returns its request id."""
        request_id = str(self._next_id)
        self._next_id += 1
        ids = list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
        text = prompt if isinstance(prompt, str) else None
        requests = self._processor.add_request(
            request_id, ids, params, prompt=text, pooling_params=pooling, lora=lora
        )
        for request in requests:
            self.core.add_request(request)
        return request_id

    def _run(self, order: list[str], desc: str, use_tqdm: bool) -> list[RequestOutput]:
        """Steps until every request has finished; their outputs in `order`."""
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc=desc, disable=not use_tqdm) as progress:
            while self.core.has_unfinished_requests():
                processed = self._processor.process_outputs(self.core.step().outputs)
                self.core.abort_requests(processed.aborts)
                for output in processed.outputs:
                    results[output.request_id] = output
                    progress.update()
        return [results[request_id] for request_id in order]

    def _compile_constraints(self, params_list: list[SamplingParams]) -> None:
        """Raises RequestValidationError for a constraint that cannot compile, before any
        request is queued."""
        for params in params_list:
            if params.structured_outputs is not None and self.core.grammars is not None:
                self.core.grammars.compile(params.structured_outputs).result()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False (and nothing done) while requests hold blocks."""
        return self.core.reset_prefix_cache()

    def close(self) -> None:
        """Releases the KV events publisher and the tensor-parallel workers, if any."""
        self.core.close()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    if isinstance(prompts, str | dict):
        return [_plain_prompt(prompts)]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return [_plain_prompt(p) for p in prompts]  # type: ignore[arg-type]


def _plain_prompt(prompt: Prompt) -> str | list[int]:
    """A prompt as text or token ids; a dict prompt must hold exactly one of them."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - PROMPT_KEYS)
    if unknown:
        raise ValueError(f"prompt keys {unknown} are not supported (only {sorted(PROMPT_KEYS)})")
    if len(prompt) != 1:
        raise ValueError('a prompt dict holds one of "prompt" and "prompt_token_ids"')
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError('"prompt" must be a string')
        return text
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
        raise ValueError('"prompt_token_ids" must be a list of ints')
    return list(ids)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
