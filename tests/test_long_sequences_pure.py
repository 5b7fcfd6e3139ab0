"""Pure checks of the long-sequence pieces (issue #44), no process group: the tiled loss and MLP against the
untiled model (and that they really tile), the whole-sequence attention mask against Transformers' own, and the
errors a bad setting gets (eager attention, heads or a length that sp does not divide, a world that sp does not
divide)."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask

from hf_zero.engine.sequence import SequenceBatch, SequenceGroups, shard_inputs, ulysses_attention
from hf_zero.integrations.sequence_parallel import enable_long_sequences, register_attention

ONE = SequenceGroups(size=1, rank=0, group=None, data_parallel_size=1, data_parallel_rank=0)


def _llama(seed=0, kv=2):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv, use_cache=False,
                                        tie_word_embeddings=False, attn_implementation="sdpa"))


class _Rsqrts(torch.overrides.TorchFunctionMode):
    """Records how many tokens each torch.rsqrt call of a [B, tokens, 1] tensor covers (RMSNorm's)."""

    def __init__(self):
        super().__init__()
        self.tokens = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.rsqrt and args[0].dim() == 3:
            self.tokens.append(args[0].shape[1])
        return func(*args, **(kwargs or {}))


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 13), generator=g)
    labels = ids.clone()
    labels[0, 2:5] = -100
    return ids, labels


def test_tiled_loss_and_mlp_equal_the_model_and_never_hold_more_than_a_tile():
    plain, tiled = _llama(), _llama()
    enable_long_sequences(tiled, ONE, tiled_loss_tokens=5, tiled_mlp_tokens=3)
    seen = {"head": [], "mlp": []}
    tiled.lm_head.register_forward_hook(lambda m, a, o: seen["head"].append(a[0].shape[-2]))
    tiled.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, a, o: seen["mlp"].append(a[0].shape[-2]))
    ids, labels = _batch()
    ref = plain(input_ids=ids, labels=labels)
    ref.loss.backward()
    with _Rsqrts() as norms:  # every RMSNorm (2 per layer and the final one) computes rsqrt over [B, tokens, 1]
        got = tiled(input_ids=ids, labels=labels)
        got.loss.backward()
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # logits_to_keep=1: the head's own call sees 1 position; the loss's tiles 5 (26 tokens: 5 tiles of 5, 1 of 1)
    assert got.logits.shape == (2, 1, 64)
    assert max(seen["head"]) <= 5 and seen["head"].count(5) == 10, seen["head"]  # 5 tiles, again in the backward
    # the MLP's own call gets 1 token, the tiles 3 (13 = 3 + 3 + 3 + 3 + 1), again in the backward's recompute
    assert max(seen["mlp"]) <= 3 and seen["mlp"].count(3) == 8, seen["mlp"]
    # the norms are tiled too: 5 norms x 4 tiles of 3 tokens in the forward (a function mode does not see the
    # backward's recompute; the MLP's hook above shows the tiles recomputed)
    assert norms.tokens and max(norms.tokens) <= 3 and norms.tokens.count(3) == 5 * 4, norms.tokens


def test_tiled_loss_divides_by_num_items_in_batch_as_transformers_does():
    plain, tiled = _llama(), _llama()
    enable_long_sequences(tiled, ONE, tiled_loss_tokens=4)
    ids, labels = _batch()
    n = torch.tensor(40)
    torch.testing.assert_close(tiled(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
                               plain(input_ids=ids, labels=labels, num_items_in_batch=n).loss, rtol=1e-6, atol=1e-6)


def test_generation_runs_whole_under_the_hooks():
    plain, tiled = _llama(), _llama()
    enable_long_sequences(tiled, ONE, tiled_loss_tokens=4, tiled_mlp_tokens=3)
    ids, _ = _batch()
    torch.testing.assert_close(tiled.generate(ids, max_new_tokens=3, do_sample=False),
                               plain.generate(ids, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_whole_sequence_mask_is_transformers_mask(kind):
    config = _llama().config
    s = 12
    positions = torch.arange(s)[None].expand(2, s)
    padding = None
    if kind == "packed":
        positions = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]),
                                 torch.cat([torch.arange(3), torch.arange(4), torch.arange(5)])])
    else:
        padding = torch.ones(2, s, dtype=torch.long)
        padding[1, 9:] = 0
    ref = create_causal_mask(config=config, inputs_embeds=torch.zeros(2, s, 32), attention_mask=padding, cache=None,
                             position_ids=positions)
    ours = SequenceBatch(groups=ONE, length=s, positions=positions,
                         padding=None if padding is None else padding.bool(),
                         separate_documents=padding is None).attention_mask()
    assert ref is not None and ours is not None
    torch.testing.assert_close(ours, ref.expand_as(ours))


def test_labels_are_shifted_before_the_cut():
    ids = torch.arange(8)[None]
    groups = SequenceGroups(size=2, rank=1, group=None, data_parallel_size=1, data_parallel_rank=0)
    out = shard_inputs({"input_ids": ids, "labels": ids.clone()}, groups)
    assert out["input_ids"].tolist() == [[4, 5, 6, 7]]
    # the first chunk's last token (3) has its target (4) in the second chunk: it is kept there too
    assert out["shift_labels"].tolist() == [[5, 6, 7, -100]]
    assert out["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert int(out["hf_zero_sequence"].valid_tokens) == 7


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        register_attention("eager")
    three = SequenceGroups(size=3, rank=0, group=None, data_parallel_size=1, data_parallel_rank=0)
    with pytest.raises(ValueError, match="4 attention heads do not divide among sequence_parallel_size=3"):
        enable_long_sequences(_llama(), three)  # at prepare time, before any forward
    two = SequenceGroups(size=2, rank=0, group=None, data_parallel_size=1, data_parallel_rank=0)
    with pytest.raises(ValueError, match="pad_to_multiple_of=2"):
        shard_inputs({"input_ids": torch.zeros(1, 7, dtype=torch.long)}, two)
    with pytest.raises(ValueError, match="launch a multiple of 3"):
        SequenceGroups.build(3, world_size=4, rank=0)
    three = SequenceGroups(size=3, rank=0, group=None, data_parallel_size=1, data_parallel_rank=0)
    seq = SequenceBatch(groups=three, length=6, positions=torch.arange(6)[None])
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="4 attention heads do not divide among sequence_parallel_size=3"):
        ulysses_attention(lambda *a, **k: None, object(), q, q, q, seq)
    four = SequenceGroups(size=4, rank=0, group=None, data_parallel_size=1, data_parallel_rank=0)
    seq = SequenceBatch(groups=four, length=8, positions=torch.arange(8)[None])
    q, kv = torch.zeros(1, 12, 2, 8), torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match="3 key/value heads cannot be replicated evenly"):
        ulysses_attention(lambda *a, **k: None, object(), q, kv, kv, seq)


def test_accelerate_parallelism_config_gives_sp_alone():
    from accelerate.parallelism_config import ParallelismConfig

    from hf_zero.integrations.accelerate import HfZeroAccelerator

    kwargs = {"parallelism_config": ParallelismConfig(sp_size=4)}
    assert HfZeroAccelerator._take_sequence_parallelism(kwargs) == 4
    assert "parallelism_config" not in kwargs  # hf_zero runs it: Accelerate would take it for DeepSpeed's Ulysses
    kept = {"parallelism_config": ParallelismConfig()}
    assert HfZeroAccelerator._take_sequence_parallelism(kept) == 1 and "parallelism_config" in kept
    with pytest.raises(ValueError, match="ring attention"):
        HfZeroAccelerator._take_sequence_parallelism({"parallelism_config": ParallelismConfig(cp_size=2)})
    with pytest.raises(ValueError, match="takes sp_size alone"):
        HfZeroAccelerator._take_sequence_parallelism({"parallelism_config": ParallelismConfig(sp_size=2, tp_size=2)})


def _mixtral(**kw):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, use_cache=False, router_aux_loss_coef=0.5,
                                            attn_implementation="sdpa", **kw))


def test_a_router_loss_per_chunk_or_tile_is_refused():
    """A MoE's auxiliary load-balancing loss is a product of means over the tokens one forward of its block sees.
    Tiled MLPs changed it (Transformers' own model: the plain loss differs from the tiled one, shown here), and sp
    chunks would too: refused, in the config and in the call. The tiled loss alone leaves it plain's."""
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    plain = _mixtral(output_router_logits=True)(input_ids=ids, labels=ids).loss
    with pytest.raises(ValueError, match="set output_router_logits=False .* or turn tiled_mlp_tokens off"):
        enable_long_sequences(_mixtral(output_router_logits=True), ONE, tiled_mlp_tokens=5)
    two = SequenceGroups(size=2, rank=0, group=None, data_parallel_size=1, data_parallel_rank=0)
    with pytest.raises(ValueError, match="under sequence_parallel_size=2"):
        enable_long_sequences(_mixtral(output_router_logits=True), two)
    asked_in_call = _mixtral()
    enable_long_sequences(asked_in_call, ONE, tiled_mlp_tokens=5)
    with pytest.raises(ValueError, match="under tiled_mlp_tokens=5"):
        asked_in_call(input_ids=ids, labels=ids, output_router_logits=True)
    tiled_loss = _mixtral(output_router_logits=True)
    enable_long_sequences(tiled_loss, ONE, tiled_loss_tokens=5)
    torch.testing.assert_close(tiled_loss(input_ids=ids, labels=ids).loss, plain)
    # what the refusal prevents: Transformers' own model with its MLPs tiled by hand, as the hooks would
    from hf_zero.engine.sequence.tiled import TiledMLP

    by_hand = _mixtral(output_router_logits=True)
    for layer in by_hand.model.layers:
        TiledMLP(5).attach(layer.mlp)
    assert abs(by_hand(input_ids=ids, labels=ids).loss.item() - plain.item()) > 1e-4
