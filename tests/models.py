"""Tiny Hugging Face causal LMs, deterministic batches, and the fine-tuning variants the tests train.

Sizes are chosen so that the parameter counts do not divide by 3 (and mostly not by 4): the total, each optimizer
param group, each decoder layer (a stage-3 unit) and the root unit, so a world size of 3 always needs padding.
"""
from __future__ import annotations

import warnings
from typing import Dict, List

import torch
import torch.nn as nn
import transformers
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

transformers.logging.set_verbosity_error()

VOCAB = 131
SEQ_LEN = 16
GLOBAL_BATCH = 12  # rows per global micro-batch: divisible by world sizes 1, 2, 3 and 4
KINDS = ("gpt2", "llama")
VARIANTS = ("full", "frozen_emb", "lora")


def _config(kind: str):
    # initializer_range 0.3: gradients large enough that clip_grad_norm_(1.0) clips in some steps and not others
    if kind == "gpt2":  # tied embeddings (lm_head.weight is transformer.wte.weight); 13153 params
        return GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=25, n_layer=2, n_head=5, n_inner=39,
            initializer_range=0.3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0,
        )
    if kind == "llama":  # untied lm_head; 44450 params
        return LlamaConfig(
            vocab_size=VOCAB, hidden_size=50, num_attention_heads=5, num_key_value_heads=5, intermediate_size=37,
            num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.3,
            use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        )
    raise ValueError(kind)


class LoRA(nn.Module):
    """A frozen projection plus a trainable low-rank update: y = base(x) + (x A^T) B^T.

    Works for nn.Linear (weight: out x in) and GPT-2's Conv1D (weight: in x out).  B starts non-zero (unlike real
    LoRA) so both A and B get gradients from the first step.
    """

    def __init__(self, base: nn.Module, rank: int, gen: torch.Generator):
        super().__init__()
        w = base.weight
        in_f, out_f = (w.shape[1], w.shape[0]) if isinstance(base, nn.Linear) else (w.shape[0], w.shape[1])
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(rank, in_f, generator=gen) * 0.2)
        self.lora_B = nn.Parameter(torch.randn(out_f, rank, generator=gen) * 0.05)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


def make_model(kind: str, variant: str = "full", seed: int = 0) -> nn.Module:
    """Same seed -> bit-identical model in every process.  variant: "full", "frozen_emb" or "lora"."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager")
    model.train()
    if variant == "frozen_emb":
        model.get_input_embeddings().weight.requires_grad_(False)  # GPT-2: also freezes the tied lm_head
        if kind == "gpt2":
            model.transformer.wpe.weight.requires_grad_(False)
    elif variant == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed + 1)
        if kind == "gpt2":
            for block in model.transformer.h:
                block.attn.c_attn = LoRA(block.attn.c_attn, 2, gen)
            model.transformer.ln_f.weight.requires_grad_(True)  # a "selected" existing param
        else:
            for layer in model.model.layers:
                layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj, 2, gen)
                layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj, 2, gen)
            model.model.norm.weight.requires_grad_(True)
    elif variant != "full":
        raise ValueError(variant)
    return model


def enable_checkpointing(model: nn.Module) -> None:
    with warnings.catch_warnings():  # transformers 5 deprecates the name in favour of activation_checkpointing_*
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()


def param_groups(model: nn.Module, lr: float = 1e-2) -> List[dict]:
    """AdamW groups: weight decay on >=2-D weights, none on biases/norms, and a different lr per group."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters() lists a tied parameter once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": 0.1, "lr": lr},
        {"params": no_decay, "weight_decay": 0.0, "lr": 3 * lr},
    ]


def make_optimizer(model: nn.Module) -> torch.optim.AdamW:
    # eps=1e-3, not 1e-8: GPT-2's key bias has an analytically zero gradient (softmax is shift-invariant), so its
    # computed gradient is ~1e-9 of rounding noise; with a tiny eps Adam would turn that noise into full-size steps
    # whose sign depends on summation order.  A larger eps also makes the update depend on the gradient's scale.
    return torch.optim.AdamW(param_groups(model), betas=(0.9, 0.95), eps=1e-3)


def make_batches(steps: int, accum: int, seed: int = 1234) -> List[List[torch.Tensor]]:
    """batches[step][micro] is a global micro-batch of token ids, GLOBAL_BATCH x SEQ_LEN (labels = inputs)."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen) for _ in range(accum)]
            for _ in range(steps)]


def rank_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    rows = batch.shape[0] // world_size
    return batch[rank * rows:(rank + 1) * rows]


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def unit_modules(model: nn.Module) -> List[nn.Module]:
    """The decoder layers (the classes in `_no_split_modules`): the default stage-3 units."""
    names = set(model._no_split_modules)
    return [m for m in model.modules() if type(m).__name__ in names]


def resident_numel(model: nn.Module, reshard_after_forward="auto") -> int:
    """Elements stage 3 keeps gathered from a forward into its backward (gathered once per micro-batch instead of
    twice), by FSDP2's / torchtitan's policy, stated here on its own: the root (everything outside the decoder
    layers: embeddings, final norm, head) never reshards; "auto" also keeps the last decoder layer, whose backward
    comes right after its forward; True keeps only the root; False keeps everything."""
    layers = unit_modules(model)
    in_layers = {id(p) for m in layers for p in m.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_layers)
    if reshard_after_forward is False:
        return sum(p.numel() for p in model.parameters())
    last = sum(p.numel() for p in layers[-1].parameters()) if reshard_after_forward == "auto" and layers else 0
    return root + last


def param_fingerprint(model: nn.Module) -> Dict[str, float]:
    return {n: float(p.detach().double().sum()) for n, p in model.named_parameters()}


def assert_no_dropout(model: nn.Module) -> None:
    """The tiny configs must have no active dropout (ranks would draw different masks than the reference)."""
    bad = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    assert not bad, f"active dropout in {bad}"
