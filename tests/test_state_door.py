"""The engine's state door (hf_zero/engine/state.py) walks a model's persistent buffers once, for three readers:
the shard state a checkpoint saves, the state-dict layout a manifest and an export record (checkpoint/layout.py),
and the loader that fills a meta model from its files (engine/loading.py). Checked here against what a plain
Hugging Face model's own `state_dict()` lists, on a model with persistent, non-persistent and shared buffers.

One process, no process group.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import hf_zero
import models
from hf_zero.checkpoint.layout import model_layout
from hf_zero.engine.state import state_dict_layout

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def buffered_llama() -> torch.nn.Module:
    """Tiny Llama (its rotary inv_freq is non-persistent) plus persistent float and int buffers, a non-persistent
    one, and one persistent tensor registered in two modules (state_dict lists it under both names)."""
    model = models.make_model("llama")
    inner = model.model
    inner.register_buffer("hfz_scale", torch.linspace(0.5, 1.5, 7))
    inner.layers[1].register_buffer("hfz_count", torch.tensor([3, 1, 4], dtype=torch.int64))
    inner.register_buffer("hfz_cache", torch.ones(5), persistent=False)
    shared = torch.arange(4.0)
    inner.layers[0].mlp.register_buffer("hfz_shared", shared)
    inner.layers[1].mlp.register_buffer("hfz_shared", shared)
    return model


def reference(model: torch.nn.Module):
    """(state_dict keys, {persistent buffer name: tensor}) from the model's own state_dict()."""
    sd = model.state_dict(keep_vars=True)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return list(sd), {k: v for k, v in sd.items() if k not in params}


def test_the_walk_lists_what_state_dict_lists():
    model = buffered_llama()
    keys, buffers = reference(model)
    assert "model.hfz_cache" not in buffers and "model.rotary_emb.inv_freq" not in buffers  # non-persistent
    assert {"model.hfz_cache", "model.rotary_emb.inv_freq"} <= {n for n, _ in model.named_buffers()}
    walked_keys, walked = state_dict_layout(model)
    assert walked_keys == keys
    assert sorted(n for b in walked for n in b.names) == sorted(buffers)
    assert len({id(b.tensor) for b in walked}) == len(walked)  # each tensor once
    for b in walked:
        assert all(buffers[n] is b.tensor for n in b.names)
        assert b.names == [k for k in keys if k in b.names]  # in state-dict order: names[0] comes first
        assert [getattr(m, a) for m, a in b.owners] == [b.tensor] * len(b.names)
    shared = next(b for b in walked if len(b.names) > 1)
    assert shared.names == ["model.layers.0.mlp.hfz_shared", "model.layers.1.mlp.hfz_shared"]


@pytest.mark.parametrize("stage", [2, 3])
def test_shard_state_and_checkpoint_layout_agree_with_state_dict(stage):
    model = buffered_llama()
    keys, buffers = reference(model)
    first = {}  # each tensor under its first state-dict name, as checkpoints keep it
    for k, v in buffers.items():
        first.setdefault(id(v), (k, v))
    engine = hf_zero.shard_model(model, models.make_optimizer(model), hf_zero.ZeroConfig(stage=stage))
    try:
        saved = engine.shard_state().buffers
        assert list(saved) == [k for k, _ in first.values()]
        assert all(saved[k] is v for k, v in first.values())
        layout, values = model_layout(engine)
        assert layout["state_dict_keys"] == keys
        assert [b["name"] for b in layout["buffers"]] == list(saved)
        assert sorted(a for b in layout["buffers"] for a in b["aliases"]) == sorted(buffers)
        assert all(values[k] is v for k, v in first.values())
        assert layout["num_parameters"] == sum(p.numel() for p in model.parameters())
    finally:
        engine.close()


def test_the_loader_fills_every_persistent_buffer_from_the_files(tmp_path):
    real = buffered_llama()
    with torch.no_grad():
        real.model.hfz_scale.mul_(3)
        real.model.layers[1].hfz_count.add_(7)
        real.model.layers[0].mlp.hfz_shared.add_(10)
    _, buffers = reference(real)
    # a file as save_pretrained writes it: every state-dict key, shared tensors as copies
    save_file({k: v.detach().clone().contiguous() for k, v in real.state_dict().items()},
              tmp_path / "model.safetensors")
    with hf_zero.parameters_on_meta():
        meta = buffered_llama()
    engine = hf_zero.shard_model(meta, models.make_optimizer(meta), hf_zero.ZeroConfig(stage=3),
                                 weights=tmp_path / "model.safetensors")
    try:
        got = dict(meta.named_buffers(remove_duplicate=False))
        for name, value in buffers.items():
            torch.testing.assert_close(got[name], value.detach(), rtol=0, atol=0)
        assert meta.model.layers[0].mlp.hfz_shared is meta.model.layers[1].mlp.hfz_shared  # still one tensor
        torch.testing.assert_close(meta.model.hfz_cache, torch.ones(5))  # non-persistent: as constructed
        torch.testing.assert_close(meta.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq)
    finally:
        engine.close()
