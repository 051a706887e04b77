"""Multi-LoRA serving: PEFT adapters applied beside the base weights, many per step.

A request names an adapter (LoRARequest); the frontend keeps the names, the engine core
reads the weights (engine/models/lora_adapter.py) into a host cache of --max-cpu-loras
adapters, and the runner copies the ones a step needs into --max-loras slots on the
device (engine/worker/lora_manager.py). Each targeted linear layer then adds, to the rows
of each adapter's tokens, x A_slot^T B_slot^T (engine/models/lora_layers.py): one shrink
and one expand GEMM per adapter segment of the step, the base model's rows untouched. The
scheduler never runs more adapters at once than there are slots, and an adapter's name is
part of its requests' prefix-cache hashes. This package is the pure-Python part: what
names an adapter, and the limits.
"""

from engine.lora.request import LoRAConfig, LoRAError, LoRARequest, parse_lora_modules

__all__ = ["LoRAConfig", "LoRAError", "LoRARequest", "parse_lora_modules"]
