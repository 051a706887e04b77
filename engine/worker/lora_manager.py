"""Which adapters are loaded and where: the engine side of multi-LoRA serving.

Adapters are read (engine/models/lora_adapter.py) into a host cache of --max-cpu-loras,
least recently used out first, and copied into one of --max-loras device slots when a
step needs them; a slot whose adapter the step does not use is reused, least recently
used first. The scheduler never runs more adapters at once than there are slots
(Scheduler's lora limit), so a step always finds room. `add` is what load_lora_adapter,
--lora-modules and each new request call: it reads and checks the adapter now (a bad one
is refused up front, and a request's adapter that fell out of the host cache is read
again, or the request refused, when it arrives); the adapters of queued and running
requests are never dropped, so a step never reads one from disk.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from engine.lora.request import LoRAConfig, LoRARequest
from engine.models.arch import ModelArch
from engine.models.layers import MLP, Linear
from engine.models.llama import DecoderLayer, DecoderModel
from engine.models.lora_adapter import LoRAAdapter, layer_slices, load_adapter
from engine.models.lora_layers import LoRASlots, LoRAStep


class LoRAManager:
    def __init__(self, model: DecoderModel, arch: ModelArch, config: LoRAConfig) -> None:
        if arch.rotary_dim is not None:
            raise ValueError(
                "--enable-lora: this model's partial rotary embeddings reorder its q/k weights "
                "at load, which adapters are not reordered for (not supported)"
            )
        self.arch = arch
        self.config = config
        self.step = LoRAStep()
        param = next(model.parameters())
        self.layers: dict[tuple[int, str], LoRASlots] = {}
        slices = layer_slices(arch)
        for index, layer in enumerate(model.layers):
            if not isinstance(layer, DecoderLayer):
                raise ValueError(
                    f"--enable-lora: {type(layer).__name__} layers take no adapters yet (LoRA "
                    "serves the Llama-family layers: Llama, Mistral, Qwen2/3, Qwen3-MoE and "
                    "Mixtral attention, Phi-3 without partial rotary embeddings)"
                )
            attn, mlp = layer.self_attn, layer.mlp
            targets = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
            if isinstance(mlp, MLP):  # not a mixture of experts' layer
                targets |= {"gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj}
            for name, linear in targets.items():
                assert isinstance(linear, Linear)
                in_features, sizes = slices[name]
                slots = LoRASlots(
                    in_features,
                    sizes,
                    config.max_loras,
                    config.max_lora_rank,
                    self.step,
                    param.dtype,
                    param.device,
                )
                linear.lora = slots
                self.layers[(index, name)] = slots
        model.lora_step = self.step
        if model.fused_layers is not None:  # the native ops carry the slots too
            model.build_fused_layers(model.fused_dense_layers is not None)
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by lora_int_id
        self._slots: list[int | None] = [None] * config.max_loras  # lora_int_id per slot
        self._slot_use: list[int] = [0] * config.max_loras
        self._uses = 0
        # The adapters queued or running requests use (set by the engine core): they stay
        # in host memory, so that a step never has to read one from disk.
        self.in_use: Callable[[], set[int]] = set

    def add(self, lora: LoRARequest) -> LoRAAdapter:
        """Reads and checks the adapter into the host cache (LoRAError if it cannot serve);
        one already there is kept as it is."""
        adapter = self._cpu.get(lora.lora_int_id)
        if adapter is None or adapter.request != lora:
            adapter = load_adapter(lora, self.arch, self.config.max_lora_rank)
            self._cpu[lora.lora_int_id] = adapter
            # A new adapter under a reused id: the slot's weights are the old one's.
            self._slots = [None if s == lora.lora_int_id else s for s in self._slots]
        self._cpu.move_to_end(lora.lora_int_id)
        if len(self._cpu) <= self.config.max_cpu_loras:
            return adapter
        # Over the limit: the least recently used out, but not one a slot holds or a
        # request uses (while more are in use than the limit, host memory holds them all).
        keep = self.in_use() | {s for s in self._slots if s is not None} | {lora.lora_int_id}
        for lora_id in list(self._cpu):
            if len(self._cpu) <= self.config.max_cpu_loras:
                break
            if lora_id not in keep:
                del self._cpu[lora_id]
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Drops the adapter from the host cache and its slot, unless requests still use it
        (they finish with it; it leaves the cache later, as any other); whether it was
        loaded."""
        loaded = lora_int_id in self._cpu
        if lora_int_id not in self.in_use():
            self._slots = [None if s == lora_int_id else s for s in self._slots]
            self._cpu.pop(lora_int_id, None)
        return loaded

    def resident(self) -> list[int]:
        """The ids in the host cache, least recently used first."""
        return list(self._cpu)

    def prepare(self, loras: list[LoRARequest | None], num_tokens: list[int]) -> None:
        """Sets the step's segments from each batch row's adapter and token count, putting
        the adapters into slots first."""
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(
                f"a step with {len(wanted)} adapters, more than --max-loras "
                f"{self.config.max_loras} (the scheduler should not allow it)"
            )
        slot_of = {}
        for lora_id, lora in wanted.items():
            slot_of[lora_id] = self._slot_for(lora, wanted)
        self.step.set(
            [-1 if lora is None else slot_of[lora.lora_int_id] for lora in loras], num_tokens
        )

    def _slot_for(self, lora: LoRARequest, wanted: dict[int, LoRARequest]) -> int:
        self._uses += 1
        if lora.lora_int_id in self._slots:
            slot = self._slots.index(lora.lora_int_id)
        else:
            free = [i for i, s in enumerate(self._slots) if s is None or s not in wanted]
            slot = min(free, key=lambda i: (self._slots[i] is not None, self._slot_use[i]))
            adapter = self.add(lora)
            for key, slots in self.layers.items():
                slots.load(slot, adapter.parts.get(key, []))
            self._slots[slot] = lora.lora_int_id
        self._slot_use[slot] = self._uses
        return slot
