"""Activation memory per device for `hf-zero estimate` (plan mode with ``--batch-size b --seq-len s``).

Activations (plan mode with ``--batch-size b --seq-len s``): bytes per device for one micro-batch, with and without
activation checkpointing, from Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", section 4.1). The paper counts, per transformer layer in 16-bit with 1-byte dropout masks,

    s·b·h·(34 + 5·a·s/h) bytes   (h hidden size, a heads, MLP 4h, GeLU, LayerNorm, dropout everywhere)

and 4·s·b·V for the fp32 log-probabilities of the loss. ``activation_bytes`` re-derives that count term by term
with e bytes per activation element (2 in bf16/fp16, 4 in fp32), m bytes per dropout-mask element (1 in the fused
GPU kernel, e in torch's CPU dropout), and the shapes of the real config (q/kv dims, MLP width f, gated MLPs,
RMSNorm, dropouts that are actually on). Per layer:

    attention  e·s·b·(h + 2·h_q + 2·h_kv)        inputs of the QKV and output projections, Q, K and V
               (h_q = a·head_dim; eager attention repeats K and V per head, so there h_kv = h_q)
               + eager:  (e + [4 if the softmax runs in fp32 and e < 4])·a·s²·b   the probabilities
                         + (e + m)·a·s²·b when attention dropout is on            dropout output + mask
               + sdpa/flash: 4·a·s·b                                            the log-sum-exp, no s² term
    MLP        e·s·b·h + e·s·b·f·(k + 1), gated (SwiGLU): e·s·b·h + e·s·b·f·(k + 3)
               (k: s·b·f tensors the activation function keeps: 1 for a fused GeLU/SiLU, 4 for GPT-2's gelu_new)
    norms      LayerNorm e·s·b·h, HF's RMSNorm (4 + e)·s·b·h (an fp32 copy of its input + the normalised input),
               each + its per-token statistics
    dropout    m·s·b·h per residual dropout that is on

With the paper's settings this is 34·s·b·h + 5·a·s²·b (plus the LayerNorm statistics the paper leaves out).
Outside the layers: the final norm, the LM head's input e·s·b·h, the loss's 4·s·b·V, the token ids.
Full activation checkpointing (one checkpoint per decoder layer, as Transformers does it) keeps only each layer's
input, e·s·b·h per layer, plus the same outside terms (and eager attention's e·b·s² mask, which the checkpoints
hold), and recomputes one layer's activations at a time in the backward. Peak = stored + the larger of that
recomputed layer (checkpointing only) and the loss's transient 8·s·b·V (the fp32 gradients of the log-probabilities
and of the logits, alive together at the start of the backward). Activations do not shrink with N: each rank runs
its own micro-batch.

Ulysses sequence parallelism over K ranks (``sequence_parallel=K``, sdpa/flash kernels only) divides the sequence:
every term above is counted for the rank's t = s·b/K tokens (attention too: after the all-to-all each rank attends
over all s positions for a/K heads, which is the same bytes), plus what the exchange adds per layer:

    e·t·h_q        the kernel's output, kept for its backward besides the exchanged result (the o_proj input)
    2·e·t·(K - kv_heads)·head_dim   when K does not divide the KV heads: each is replicated to K heads first, and
                   the kernel keeps the replicas

and outside the layers the whole sequence's shifted labels, 8·s·b bytes on every rank (the loss's count of valid
tokens), in place of the 8·t of the token ids.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn

from ...config import ZeroConfig
from .plan import as_model as _as_model


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

ATTENTION_KINDS = ("eager", "sdpa")  # sdpa: a fused (flash / memory-efficient) kernel that never stores a·s²·b
# Eager attention in HF models computes the softmax in fp32 and casts it back (two copies of a·s²·b in 16-bit);
# GPT-2's eager attention keeps the compute dtype. Only matters for eager attention in bf16/fp16.
_SOFTMAX_IN_COMPUTE_DTYPE = frozenset({"gpt2"})
_DROPOUT_KEYS = {  # config attribute names of the three dropouts, first match wins
    "attn": ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob"),
    "resid": ("resid_pdrop", "hidden_dropout", "hidden_dropout_prob"),
    "embd": ("embd_pdrop", "embedding_dropout"),
}


@dataclasses.dataclass(frozen=True)
class ActivationShape:
    """What the activation formula needs from a model: sizes plus the few implementation facts that change bytes."""

    layers: int
    hidden: int  # h
    heads: int  # a
    kv_heads: int
    head_dim: int
    intermediate: int  # f
    vocab: int  # V
    gated_mlp: bool  # SwiGLU-style: act(gate(x)) * up(x)
    act_saved: int  # s·b·f tensors the activation function keeps for its backward, besides its output
    rms_norm: bool  # HF's RMSNorm (keeps an fp32 copy of its input) rather than LayerNorm
    softmax_fp32: bool  # eager attention's softmax runs in fp32
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0


def _first_attr(config: Any, names: Sequence[str], default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def activation_saved_tensors(act_name: str) -> int:
    """How many input-sized tensors an HF activation function keeps for its backward (its output excluded: that one
    is the next projection's input and is counted there). Found by running it once on a tiny tensor, so unfused
    Python activations (GPT-2's gelu_new keeps 4) are counted as they really are."""
    from ...integrations.hf_models import activation_function

    act = activation_function(act_name)
    if act is None:
        return 1  # unknown to Transformers: assume a fused kernel that keeps its input, as the paper does
    x = torch.linspace(-3, 3, 16).reshape(2, 8).requires_grad_()  # no randn: leave the caller's RNG alone
    saved: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = act(x)
    saved.pop(y.untyped_storage().data_ptr(), None)
    return sum(1 for nbytes in saved.values() if nbytes == x.untyped_storage().nbytes())


def activation_shape(model_or_config: Any) -> ActivationShape:
    """The ActivationShape of an HF causal LM (module or meta-device build) or of its config / local config path."""
    model = _as_model(model_or_config)
    cfg = model.config
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    names = [name.rsplit(".", 1)[-1] for name, _ in model.named_modules()]
    act = _first_attr(cfg, ("hidden_act", "activation_function"), "gelu")
    dropout = {k: float(_first_attr(cfg, keys, 0.0)) for k, keys in _DROPOUT_KEYS.items()}
    return ActivationShape(
        layers=cfg.num_hidden_layers, hidden=hidden, heads=heads,
        kv_heads=_first_attr(cfg, ("num_key_value_heads",), heads), head_dim=head_dim,
        intermediate=_first_attr(cfg, ("intermediate_size", "n_inner", "ffn_dim"), 4 * hidden),
        vocab=cfg.vocab_size,
        gated_mlp=any(n in ("gate_proj", "gate_up_proj") for n in names),
        act_saved=activation_saved_tensors(act),
        rms_norm=any(type(m).__name__.endswith("RMSNorm") for m in model.modules()),
        softmax_fp32=getattr(cfg, "model_type", "") not in _SOFTMAX_IN_COMPUTE_DTYPE,
        attn_dropout=dropout["attn"], resid_dropout=dropout["resid"], embd_dropout=dropout["embd"],
    )


def paper_layer_bytes(seq_len: int, batch_size: int, hidden: int, heads: int) -> float:
    """Korthikanti et al. 2022, section 4.1: one layer's activations in 16-bit, no checkpointing,
    s·b·h·(34 + 5·a·s/h) bytes."""
    s, b, h, a = seq_len, batch_size, hidden, heads
    return s * b * h * (34 + 5 * a * s / h)


def _norm_bytes(shape: ActivationShape, tokens: int, e: int) -> int:
    """One norm: its saved input (RMSNorm: an fp32 copy, plus the normalised input for the weight's gradient) and
    its per-token statistics (LayerNorm: mean and 1/std, RMSNorm: 1/rms, fp32)."""
    if shape.rms_norm:
        return tokens * ((4 + e) * shape.hidden + 4)
    return tokens * (e * shape.hidden + 8)


def _check_sequence_parallel(shape: ActivationShape, seq_len: int, attention: str, sp: int) -> None:
    """The conditions Ulysses attention (engine/sequence/attention.py) runs under."""
    if sp < 1:
        raise ValueError(f"sequence_parallel must be at least 1, got {sp}")
    if sp == 1:
        return
    if attention == "eager":
        raise ValueError("sequence parallelism runs fused attention kernels (sdpa, flash), not eager attention")
    if seq_len % sp or shape.heads % sp:
        raise ValueError(f"sequence_parallel={sp} must divide the sequence ({seq_len}) and the heads ({shape.heads})")
    if shape.kv_heads % sp and sp % shape.kv_heads:
        raise ValueError(f"{shape.kv_heads} key/value heads cannot be replicated onto sequence_parallel={sp} ranks")


def _ulysses_bytes(shape: ActivationShape, tokens: int, e: int, sp: int) -> int:
    """What a layer keeps beyond the plain count at `tokens` per rank under Ulysses: the kernel's own output, and
    the KV replicas when sp does not divide the KV heads (module docstring)."""
    if sp == 1:
        return 0
    replicas = 2 * e * tokens * (sp - shape.kv_heads) * shape.head_dim if shape.kv_heads % sp else 0
    return e * tokens * shape.heads * shape.head_dim + replicas


def layer_activation_bytes(shape: ActivationShape, batch_size: int, seq_len: int, dtype_bytes: int = 2,
                           attention: str = "eager", mask_bytes: int = 1, sequence_parallel: int = 1) -> Dict[str, int]:
    """Bytes one decoder layer keeps for its backward (no checkpointing), by term, on one rank; see the module
    docstring (`sequence_parallel`: Ulysses over that many ranks, each holding seq_len / sequence_parallel tokens)."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    sp = sequence_parallel
    _check_sequence_parallel(shape, seq_len, attention, sp)
    seq_len //= sp  # every term below is per rank (attention's a·s over a/K heads is the same bytes)
    e, m, t = dtype_bytes, mask_bytes, batch_size * seq_len
    h, a, f = shape.hidden, shape.heads, shape.intermediate
    h_q = a * shape.head_dim
    h_kv = h_q if attention == "eager" else shape.kv_heads * shape.head_dim  # eager's repeat_kv materialises K, V
    scores = a * seq_len * seq_len * batch_size
    attn = e * t * (h + 2 * h_q + 2 * h_kv)
    if attention == "eager":
        attn += (e + (4 if shape.softmax_fp32 and e < 4 else 0)) * scores
        if shape.attn_dropout > 0:
            attn += (e + m) * scores
    else:
        attn += 4 * a * t  # log-sum-exp per query and head
    mlp = e * t * h + e * t * f * (shape.act_saved + (3 if shape.gated_mlp else 1))
    resid_masks = 2 * m * t * h if shape.resid_dropout > 0 else 0
    norms = 2 * _norm_bytes(shape, t, e)
    out = {"attention": attn, "mlp": mlp, "norms": norms, "dropout_masks": resid_masks}
    if sp > 1:
        out["ulysses"] = _ulysses_bytes(shape, t, e, sp)
    out["total"] = sum(out.values())
    return out


def activation_bytes(shape: ActivationShape, batch_size: int, seq_len: int, dtype_bytes: int = 2,
                     checkpointing: bool = False, attention: str = "eager", mask_bytes: int = 1,
                     sequence_parallel: int = 1) -> Dict[str, int]:
    """Activation bytes per device for one micro-batch of `batch_size` x `seq_len` tokens (split over
    `sequence_parallel` ranks by Ulysses: per rank).

    Returns per_layer (one layer's full activations), layers (what the decoder layers keep for the backward),
    outside (embeddings' ids and masks, final norm, LM head input, the loss's fp32 log-probabilities), stored
    (= layers + outside, held from the forward to the backward), transient and peak (= stored + transient).
    """
    sp = sequence_parallel
    per_layer = layer_activation_bytes(shape, batch_size, seq_len, dtype_bytes, attention, mask_bytes, sp)["total"]
    ids = 8 * batch_size * seq_len  # the token ids; under sp the whole sequence's shifted labels, on every rank
    e, t = dtype_bytes, batch_size * (seq_len // sp)
    logprobs = 4 * t * shape.vocab
    outside = (ids + _norm_bytes(shape, t, e) + e * t * shape.hidden + logprobs
               + (mask_bytes * t * shape.hidden if shape.embd_dropout > 0 else 0))
    loss_transient = 2 * logprobs
    if checkpointing:
        layers = shape.layers * e * t * shape.hidden  # each layer's input
        if attention == "eager":
            outside += e * batch_size * seq_len * seq_len  # the 4-D mask every checkpointed layer holds
        transient = max(per_layer, loss_transient)
    else:
        layers = shape.layers * per_layer
        transient = loss_transient
    stored = layers + outside
    return {"per_layer": per_layer, "layers": layers, "outside": outside, "stored": stored,
            "transient": transient, "peak": stored + transient}


def _activation_dtype_bytes(model: nn.Module, config: ZeroConfig) -> int:
    """Activations are in the compute dtype (mixed precision) or in the model's own floating dtype."""
    if config.compute_dtype is not None:
        return _elem(config.compute_dtype)
    dtypes = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    return _elem(dtypes[0]) if dtypes else 4


def activation_report(model_or_config: Any, batch_size: int, seq_len: int, config: Optional[ZeroConfig] = None,
                      attention: str = "eager", mask_bytes: int = 1) -> Dict[str, Any]:
    """Activations per device with and without checkpointing, plus the shape and settings they came from."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError("batch_size and seq_len must be positive")
    config = config if config is not None else ZeroConfig()
    model = _as_model(model_or_config)
    shape = activation_shape(model)
    e = _activation_dtype_bytes(model, config)
    modes = {name: activation_bytes(shape, batch_size, seq_len, e, ckpt, attention, mask_bytes)
             for name, ckpt in (("no_checkpointing", False), ("checkpointing", True))}
    paper = shape.layers * paper_layer_bytes(seq_len, batch_size, shape.hidden, shape.heads)
    return {"batch_size": batch_size, "seq_len": seq_len, "dtype_bytes": e, "attention": attention,
            "mask_bytes": mask_bytes, "shape": dataclasses.asdict(shape), **modes,
            "paper_layers_16bit": paper,
            "formula": "Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes per layer (16-bit) + 4*s*b*V for the "
                       "loss; re-derived per term for this config (see hf_zero.tools.estimate.activations); checkpointing keeps "
                       "e*s*b*h per layer and recomputes one layer at a time"}
