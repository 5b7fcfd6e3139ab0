"""What the capacity table compares: the model shapes (a Llama at a fixed width, layers added), the modes (full
fine-tune, LoRA), and the systems, each built the way its users build a model that does not fit on a rank whole:

- ddp, deepspeed_zero1/2: the whole model on every rank (they keep every parameter on every rank anyway);
- fsdp2: the torchtitan way, the model on the meta device, `fully_shard` on each decoder layer and the root,
  `to_empty`, each rank initialising its own shards (the buffers, rotary `inv_freq`, kept as computed);
- deepspeed_zero3 (and -int8): Transformers' own `zero.Init` path (`HfDeepSpeedConfig` alive while the model is
  built), each rank allocating its partition only;
- hf_zero (zero1-3, zero3-offload, zero3-int8): `hf_zero.from_pretrained` (meta) and `shard_model` reading a random
  checkpoint straight into each rank's shards (stage 3: the rank's byte ranges only; stages 1-2 hold every
  parameter, as they must).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

# Model shapes: Llama at a fixed width, layers added by the search. "tiny" is the default run's (a few minutes);
# "llama7b" is Llama-2-7B's shape (6.74e9 parameters at 32 layers).
SHAPES: Dict[str, Dict[str, int]] = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, vocab_size=2048),
    "small": dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, vocab_size=4096),
    "llama7b": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, vocab_size=32000),
}
LORA_TARGETS = ("q_proj", "v_proj")
MODES = ("full", "lora")
DEFAULT_SYSTEMS = "ddp,zero1,zero2,zero3"


@dataclass(frozen=True)
class CapacitySystem:
    """A system of the capacity table: its family (how its model is built and trained), its ZeRO stage (the
    estimator's), its extra options (hf_zero: ZeroConfig fields; DeepSpeed: zero_optimization keys) and the modes
    it has a row in."""

    family: str  # "ddp", "fsdp2", "deepspeed", "hf_zero"
    stage: int
    options: Tuple[Tuple[str, Any], ...] = ()
    modes: Tuple[str, ...] = MODES
    note: str = ""


SYSTEMS: Dict[str, CapacitySystem] = {
    "ddp": CapacitySystem("ddp", 0, note="torch DDP, the whole model on every rank"),
    "fsdp2": CapacitySystem("fsdp2", 3, note="torch FSDP2: meta build, fully_shard(layers, root), to_empty"),
    **{f"deepspeed_zero{k}": CapacitySystem("deepspeed", k, note=f"DeepSpeed ZeRO-{k}" + (
        " (Transformers' zero.Init build)" if k == 3 else "")) for k in (1, 2, 3)},
    **{f"zero{k}": CapacitySystem("hf_zero", k, note=f"hf_zero stage {k}, loaded into shards") for k in (1, 2, 3)},
    "zero3-offload": CapacitySystem("hf_zero", 3, (("offload_optimizer", "cpu"), ("offload_params", "cpu")),
                                    note="hf_zero stage 3, offload_optimizer='cpu', offload_params='cpu'"),
    "zero3-int8": CapacitySystem("hf_zero", 3, (("quantized_frozen_weights", "int8"),), modes=("lora",),
                                 note="hf_zero stage 3, quantized_frozen_weights='int8' (frozen shards as int8 "
                                      "codes + fp32 scales; only a LoRA base is frozen)"),
    # DeepSpeed's own int8 frozen weights (zero_quantized_nontrainable_weights), for the 7B demonstration
    "deepspeed_zero3-int8": CapacitySystem("deepspeed", 3, (("zero_quantized_nontrainable_weights", True),),
                                           modes=("lora",), note="DeepSpeed ZeRO-3, "
                                           "zero_quantized_nontrainable_weights=True"),
}
ALL_SYSTEMS = [n for n in SYSTEMS if n != "deepspeed_zero3-int8"]


def parse_system(text: str) -> Tuple[str, str]:
    """"fsdp2:bf16" -> ("fsdp2", "bf16"): a peer with its parameters stored in bf16 (ddp / fsdp2: pure bf16, AdamW
    states in bf16 too; DeepSpeed: its bf16 mode, fp32 master and states of the trainable parameters)."""
    name, _, dtype = text.strip().partition(":")
    dtype = dtype or "fp32"
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)} (or 'all')")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"{text!r}: the dtype after ':' is fp32 or bf16")
    if dtype == "bf16" and SYSTEMS[name].family == "hf_zero":
        raise ValueError(f"{text!r}: hf_zero rows train in fp32 here (zero3-int8 is its low-memory form); "
                         f"':bf16' is for the peers")
    return name, dtype


def parse_systems(text: str) -> List[str]:
    """A comma-separated list of systems ("all": every one but DeepSpeed's int8), each checked, duplicates
    dropped; ValueError names an unknown one."""
    names: List[str] = []
    for part in text.split(","):
        part = part.strip()
        if part == "all":
            names += ALL_SYSTEMS
        elif part:
            parse_system(part)
            names.append(part)
    if not names:
        raise ValueError("no system named (e.g. --capacity-systems ddp,zero3)")
    return list(dict.fromkeys(names))



def parse_modes(text: str) -> List[str]:
    """"full,lora" -> ["full", "lora"]; ValueError names an unknown mode."""
    modes = list(dict.fromkeys(m.strip() for m in str(text).split(",") if m.strip()))
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes are {', '.join(MODES)} (comma-separated), got {text!r}")
    return modes


def apply_lora(model: Any, mode: str, lora_rank: int) -> Any:
    """`model` with PEFT's LoRA on LORA_TARGETS in mode "lora" (rank `lora_rank`, alpha 2 x rank), else as it is."""
    if mode != "lora":
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=int(lora_rank), lora_alpha=2 * int(lora_rank), lora_dropout=0.0,
                                            target_modules=list(LORA_TARGETS)))
