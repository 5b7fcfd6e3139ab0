"""hf_zero.parameters_on_meta (issue 34, item 5): parameters on meta, buffers as a normal build makes them, and no
torch attribute replaced, so other threads build their modules as usual."""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import hf_zero


def _llama_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=97, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=37, num_hidden_layers=2, max_position_embeddings=64, rope_theta=5000.0,
                       tie_word_embeddings=False, use_cache=False)


class _Net(nn.Module):
    """Persistent and non-persistent buffers computed in the constructor, and a parameter with an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("table", torch.arange(12.0).reshape(3, 4).sin(), persistent=True)
        self.register_buffer("inv", 1.0 / (10.0 ** (torch.arange(0, 6, 2).float() / 6)), persistent=False)
        p = nn.Parameter(torch.ones(4), requires_grad=False)
        p.tag = "kept"
        self.extra = p


def _check_like_reference(built: nn.Module, reference: nn.Module) -> None:
    params, ref_params = dict(built.named_parameters()), dict(reference.named_parameters())
    assert params.keys() == ref_params.keys() and params
    for name, p in params.items():
        ref = ref_params[name]
        assert p.is_meta, name
        assert type(p) is type(ref) and p.shape == ref.shape and p.dtype == ref.dtype, name
        assert p.requires_grad == ref.requires_grad, name
    buffers, ref_buffers = dict(built.named_buffers()), dict(reference.named_buffers())
    assert buffers.keys() == ref_buffers.keys() and buffers
    for name, b in buffers.items():
        assert not b.is_meta, name
        torch.testing.assert_close(b, ref_buffers[name], rtol=0, atol=0, msg=name)


def test_parameters_on_meta_and_buffers_as_a_normal_build():
    torch.manual_seed(0)
    reference = LlamaForCausalLM(_llama_config())
    with hf_zero.parameters_on_meta():
        built = LlamaForCausalLM(_llama_config())
    _check_like_reference(built, reference)
    # the rotary inv_freq a non-persistent buffer: real values, not zeros or meta
    inv = dict(built.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv.abs().min() > 0
    assert not any("inv_freq" in k for k in built.state_dict())

    reference_net = _Net()
    with hf_zero.parameters_on_meta():
        net = _Net()
    _check_like_reference(net, reference_net)
    assert net.extra.tag == "kept" and not net.extra.requires_grad
    assert set(net.state_dict()) == set(reference_net.state_dict())


def test_no_torch_attribute_is_replaced_and_the_block_nests():
    register, setattr_, parameter_new = nn.Module.register_parameter, nn.Module.__setattr__, nn.Parameter.__new__
    with hf_zero.parameters_on_meta():
        assert nn.Module.register_parameter is register
        assert nn.Module.__setattr__ is setattr_ and nn.Parameter.__new__ is parameter_new
        with hf_zero.parameters_on_meta():
            assert nn.Linear(2, 2).weight.is_meta
        assert nn.Linear(2, 2).weight.is_meta  # still inside the outer block
    assert nn.Module.register_parameter is register
    assert not nn.Linear(2, 2).weight.is_meta
    with pytest.raises(RuntimeError, match="boom"):
        with hf_zero.parameters_on_meta():
            raise RuntimeError("boom")
    assert not nn.Linear(2, 2).weight.is_meta  # an error inside leaves nothing behind


def test_other_threads_build_real_parameters_during_the_block():
    built = {}

    def build(key: str) -> None:
        torch.manual_seed(1)
        built[key] = nn.Linear(4, 3)

    with hf_zero.parameters_on_meta():
        mine = nn.Linear(4, 3)
        other = threading.Thread(target=build, args=("other",))
        other.start()
        other.join()
        assert mine.weight.is_meta
    assert not built["other"].weight.is_meta and not built["other"].bias.is_meta
    torch.manual_seed(1)
    torch.testing.assert_close(built["other"].weight, nn.Linear(4, 3).weight, rtol=0, atol=0)

    # and the other way round: a thread's block leaves this thread's modules alone
    inside, release = threading.Event(), threading.Event()

    def build_on_meta() -> None:
        with hf_zero.parameters_on_meta():
            built["meta"] = nn.Linear(4, 3)
            inside.set()
            release.wait()

    worker = threading.Thread(target=build_on_meta)
    worker.start()
    try:
        assert inside.wait(timeout=60)
        assert not nn.Linear(4, 3).weight.is_meta
    finally:
        release.set()
        worker.join()
    assert built["meta"].weight.is_meta
