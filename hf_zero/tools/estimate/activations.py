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

and outside the layers the whole sequence's shifted labels, 8·s bytes on every rank at b = 1 (the loss keeps its
chunk flattened, a view of them), in place of the 8·t of the token ids; at b > 1 flattening a chunk copies it and
8·t it stays.

Tiles (``tiled_loss_tokens=T``, ``tiled_mlp_tokens=T``, engine/sequence/tiled.py) run a position-wise computation
piece by piece, each piece under a non-reentrant checkpoint that keeps only its input and is recomputed in the
backward; on top of sp (t = s·b/K tokens per rank) and checkpointing:

    tiled loss  the head and the cross-entropy over tiles of n = min(T, t) tokens (the rank's batch flattened).
                The forward keeps the final hidden states (the LM head's input above, e·t·h) and no log-probabilities:
                no 4·t·V. The transient is one tile's, 12·n·V at the start of its backward (its recomputed fp32
                log-probabilities and the fp32 gradients of the log-probabilities and of the logits), in place of
                8·t·V: with T >= t the peak is the untiled one, the log-probabilities moved from stored to transient
    tiled MLP   every module named "mlp" and every LayerNorm/RMSNorm over tiles of the sequence dimension, each tile
                b·T' tokens with T' = min(T, s/K); T >= s/K runs them whole (the count above). Per layer the MLP
                keeps its input, e·t·h (the post-attention norm's output, as above), and each norm its input, e·t·h
                (no fp32 copy, no statistics); a dropout inside the MLP (GPT-2's) keeps its mask in the tile. The
                final norm keeps e·t·h too. The backward recomputes one tile at a time: the MLP term at n = b·T'
                tokens (a norm's tile is smaller) is added to the transient, to the recomputed layer's under
                checkpointing
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
    mlp_dropout: bool = False  # one of the residual dropouts is inside the module named "mlp" (GPT-2's)


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
    mlp_dropout = any(isinstance(sub, nn.Dropout) for name, m in model.named_modules()
                      if name.rsplit(".", 1)[-1] == "mlp" for sub in m.modules())
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
        mlp_dropout=mlp_dropout,
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


def _mlp_bytes(shape: ActivationShape, tokens: int, e: int) -> int:
    """One MLP: the input of its first projection(s), the activation function's saved tensors and output (gated: the
    gate's and up projection's outputs and their product too)."""
    return e * tokens * shape.hidden + e * tokens * shape.intermediate * (shape.act_saved + (3 if shape.gated_mlp
                                                                                             else 1))


def _tile(tile_tokens: int, tokens: int) -> int:
    """Tokens in the largest tile: 0 when tiling is off (0) or the tiles would cover the whole `tokens`."""
    if tile_tokens < 0:
        raise ValueError(f"tile tokens must be at least 0 (0: off), got {tile_tokens}")
    return tile_tokens if 0 < tile_tokens < tokens else 0


def mlp_tile_bytes(shape: ActivationShape, batch_size: int, seq_len: int, dtype_bytes: int = 2, mask_bytes: int = 1,
                   sequence_parallel: int = 1, tiled_mlp_tokens: int = 0) -> int:
    """What the tiled MLP recomputes at once in the backward: one MLP tile's activations (b·min(T, s/K) tokens; the
    norms' tiles are smaller); 0 when the MLPs run whole (module docstring)."""
    tile = _tile(tiled_mlp_tokens, seq_len // sequence_parallel)
    if not tile:
        return 0
    n = batch_size * tile
    mask = mask_bytes * n * shape.hidden if shape.mlp_dropout and shape.resid_dropout > 0 else 0
    return _mlp_bytes(shape, n, dtype_bytes) + mask


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
                           attention: str = "eager", mask_bytes: int = 1, sequence_parallel: int = 1,
                           tiled_mlp_tokens: int = 0) -> Dict[str, int]:
    """Bytes one decoder layer keeps for its backward (no checkpointing), by term, on one rank; see the module
    docstring (`sequence_parallel`: Ulysses over that many ranks, each holding seq_len / sequence_parallel tokens;
    `tiled_mlp_tokens`: the MLP and norms over tiles of that many positions, keeping their inputs only)."""
    if attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
    sp = sequence_parallel
    _check_sequence_parallel(shape, seq_len, attention, sp)
    seq_len //= sp  # every term below is per rank (attention's a·s over a/K heads is the same bytes)
    tiled = bool(_tile(tiled_mlp_tokens, seq_len))
    e, m, t = dtype_bytes, mask_bytes, batch_size * seq_len
    h, a = shape.hidden, shape.heads
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
    mlp = e * t * h if tiled else _mlp_bytes(shape, t, e)  # tiled: the checkpoints' input only
    resid_masks = (1 if tiled and shape.mlp_dropout else 2) * m * t * h if shape.resid_dropout > 0 else 0
    norms = 2 * (e * t * h if tiled else _norm_bytes(shape, t, e))  # tiled: each norm's input
    out = {"attention": attn, "mlp": mlp, "norms": norms, "dropout_masks": resid_masks}
    if sp > 1:
        out["ulysses"] = _ulysses_bytes(shape, t, e, sp)
    out["total"] = sum(out.values())
    return out


def activation_bytes(shape: ActivationShape, batch_size: int, seq_len: int, dtype_bytes: int = 2,
                     checkpointing: bool = False, attention: str = "eager", mask_bytes: int = 1,
                     sequence_parallel: int = 1, tiled_loss_tokens: int = 0,
                     tiled_mlp_tokens: int = 0) -> Dict[str, int]:
    """Activation bytes per device for one micro-batch of `batch_size` x `seq_len` tokens (split over
    `sequence_parallel` ranks by Ulysses: per rank; the loss and the MLPs and norms over tiles of
    `tiled_loss_tokens` and `tiled_mlp_tokens` tokens when not 0).

    Returns per_layer (one layer's full activations), layers (what the decoder layers keep for the backward),
    outside (embeddings' ids and masks, final norm, LM head input, the loss's fp32 log-probabilities unless tiled),
    stored (= layers + outside, held from the forward to the backward), transient and peak (= stored + transient).
    """
    sp = sequence_parallel
    per_layer = layer_activation_bytes(shape, batch_size, seq_len, dtype_bytes, attention, mask_bytes, sp,
                                       tiled_mlp_tokens)["total"]
    if tiled_loss_tokens < 0:
        raise ValueError(f"tiled_loss_tokens must be at least 0 (0: off), got {tiled_loss_tokens}")
    e, t = dtype_bytes, batch_size * (seq_len // sp)
    # the loss's flattened labels: under sp at b = 1 a view of the whole sequence's shifted labels, on every rank
    ids = 8 * (seq_len if batch_size == 1 else t)
    mlp_tile = mlp_tile_bytes(shape, batch_size, seq_len, e, mask_bytes, sp, tiled_mlp_tokens)
    final_norm = e * t * shape.hidden if mlp_tile else _norm_bytes(shape, t, e)  # tiled: its input only
    if tiled_loss_tokens:  # a tile's logits exist in its checkpoint's recomputation only (module docstring)
        logprobs, loss_transient = 0, 12 * min(tiled_loss_tokens, t) * shape.vocab
    else:
        logprobs = 4 * t * shape.vocab
        loss_transient = 2 * logprobs
    outside = (ids + final_norm + e * t * shape.hidden + logprobs
               + (mask_bytes * t * shape.hidden if shape.embd_dropout > 0 else 0))
    if checkpointing:
        layers = shape.layers * e * t * shape.hidden  # each layer's input
        if attention == "eager":
            outside += e * batch_size * seq_len * seq_len  # the 4-D mask every checkpointed layer holds
        transient = max(per_layer + mlp_tile, loss_transient)
    else:
        layers = shape.layers * per_layer
        transient = max(mlp_tile, loss_transient)
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
    """Activations per device with and without checkpointing, plus the shape and settings they came from.
    `config`'s sequence_parallel_size, tiled_loss_tokens and tiled_mlp_tokens are counted as the run would use them
    (the batch_size x seq_len micro-batch is one replica's: each sp rank holds seq_len / sequence_parallel_size)."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError("batch_size and seq_len must be positive")
    config = config if config is not None else ZeroConfig()
    model = _as_model(model_or_config)
    shape = activation_shape(model)
    e = _activation_dtype_bytes(model, config)
    long = dict(sequence_parallel=config.sequence_parallel_size, tiled_loss_tokens=config.tiled_loss_tokens,
                tiled_mlp_tokens=config.tiled_mlp_tokens)
    modes = {name: activation_bytes(shape, batch_size, seq_len, e, ckpt, attention, mask_bytes, **long)
             for name, ckpt in (("no_checkpointing", False), ("checkpointing", True))}
    paper = shape.layers * paper_layer_bytes(seq_len, batch_size, shape.hidden, shape.heads)
    return {"batch_size": batch_size, "seq_len": seq_len, "dtype_bytes": e, "attention": attention,
            "mask_bytes": mask_bytes, "shape": dataclasses.asdict(shape), **long, **modes,
            "paper_layers_16bit": paper,
            "formula": "Korthikanti et al. 2022: s*b*h*(34 + 5*a*s/h) bytes per layer (16-bit) + 4*s*b*V for the "
                       "loss; re-derived per term for this config (see hf_zero.tools.estimate.activations); "
                       "checkpointing keeps e*s*b*h per layer and recomputes one layer at a time; sequence "
                       "parallelism counts t = s*b/K tokens per rank; a tiled loss keeps no log-probabilities (one "
                       "tile's 12*T*V transient), a tiled MLP only each MLP's and norm's input (one tile recomputed "
                       "at a time)"}
