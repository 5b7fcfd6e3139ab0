"""Model shapes the tools know by name (the bench's presets, the load bench's, a few public models' under their Hub
names), and a Llama of a given size.

Each is a Transformers config as a dict (`model_type` plus the shape), built from scratch: nothing is downloaded.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

__all__ = ["HUB_SHAPES", "LOAD_PRESETS", "PRESETS", "llama_of_size", "names", "preset"]

PRESETS: Dict[str, Dict[str, Any]] = {
    # GPT-2 small (124M): the shapes of the `gpt2` checkpoint, built from scratch.
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    # A GPT-2 of ~5.4M parameters (4 layers x 256, vocabulary 8192): per-step overhead shows here, not at 124M.
    "gpt2-5m": dict(model_type="gpt2", vocab_size=8192, n_positions=512, n_embd=256, n_layer=4, n_head=4,
                    bos_token_id=0, eos_token_id=0),
    # A GPT-2 of ~141K parameters for tests and smoke runs.
    "tiny": dict(model_type="gpt2", vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                 eos_token_id=0),
}

# Presets only big enough to see loading memory; for manual runs (minutes on a CPU).
LOAD_PRESETS: Dict[str, Dict[str, Any]] = {
    # A Llama of ~271M parameters: 16 layers of width 1024, vocabulary 32000, untied embeddings.
    "llama270m": dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                      max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}

# Public models' shapes under their Hub names (from their config.json; built from scratch, never downloaded).
HUB_SHAPES: Dict[str, Dict[str, Any]] = {
    "HuggingFaceTB/SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                       max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=0,
                                       eos_token_id=0),
    "meta-llama/Llama-2-7b-hf": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                     max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
                                     eos_token_id=2),
    "meta-llama/Llama-2-70b-hf": dict(model_type="llama", vocab_size=32000, hidden_size=8192,
                                      intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                                      num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=2),
}

_VOCAB = 32000


def llama_of_size(params: float) -> Dict[str, Any]:
    """A Llama config of about `params` parameters: width h a multiple of 128 with about h / 128 layers (Llama-7B's
    aspect: 4096 wide, 32 deep), MLP 8h/3 rounded up to 256, heads of 128, untied embeddings. Each layer holds
    4h^2 + 3h*i + 2h parameters, the embeddings and head 2*32000*h; the depth is chosen to land nearest `params`."""
    if params < 1e6:
        raise ValueError(f"--params {params:g} is too small for a Llama shape (at least 1e6)")
    h = 128
    while True:  # the widest h whose aspect-ratio depth still fits
        nh = h + 128
        if _per_layer(nh) * (nh // 128) + 2 * _VOCAB * nh > params:
            break
        h = nh
    layers = max(1, round((params - 2 * _VOCAB * h) / _per_layer(h)))
    return dict(model_type="llama", vocab_size=_VOCAB, hidden_size=h, intermediate_size=_mlp(h),
                num_hidden_layers=layers, num_attention_heads=h // 128, num_key_value_heads=h // 128,
                max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _mlp(h: int) -> int:
    return -(-8 * h // 3 // 256) * 256


def _per_layer(h: int) -> int:
    return 4 * h * h + 3 * h * _mlp(h) + 2 * h


def preset(name: str) -> Optional[Dict[str, Any]]:
    """The config of a preset (the bench's, the load bench's or a Hub shape) as a dict, or None."""
    found = {**PRESETS, **LOAD_PRESETS, **HUB_SHAPES}.get(name)
    return dict(found) if found is not None else None


def names() -> List[str]:
    return sorted({**PRESETS, **LOAD_PRESETS, **HUB_SHAPES})
