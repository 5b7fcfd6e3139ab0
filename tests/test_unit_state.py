"""A stage-3 unit's one gather state (engine/unit_state.py): the transitions, the staleness of a gather made before
a step, and that the unit's flat groups answer "gathered?" from it. Pure logic: no process group."""
import pytest
import torch

from hf_zero.engine.unit_state import GatherState, ShardedState, TrainingState, UnitState


def test_a_unit_moves_sharded_gathering_gathered_and_back():
    st = UnitState()
    assert st.sharded and not st.gathered
    st.to_gathering([0, 0])
    assert st.value is GatherState.GATHERING and not st.sharded and not st.gathered
    st.to_gathered()
    assert st.gathered and not st.sharded
    st.to_sharded()
    assert st.sharded and not st.gathered


def test_gathering_twice_or_gathered_before_gathering_is_a_bug():
    st = UnitState()
    with pytest.raises(AssertionError):
        st.to_gathered()
    st.to_gathering([1])
    with pytest.raises(AssertionError):
        st.to_gathering([1])


def test_a_gather_is_stale_once_a_shard_version_changes():
    st = UnitState()
    assert not st.stale([3, 4])  # nothing gathered: nothing stale
    st.to_gathering([3, 4])
    assert not st.stale([3, 4])
    st.to_gathered()
    assert st.stale([3, 5]) and st.stale([4, 4])
    st.to_sharded()
    assert not st.stale([9, 9])


def test_an_engine_answers_gathered_from_the_unit_state():
    """One process (no process group): outside a forward every unit is sharded, its parameters refuse reads and no
    gathered bytes are counted; inside gathered_parameters() every parameter reads the same values as a copy of the
    model trained without hf_zero would hold, and the gathered bytes cover every parameter."""
    import copy

    import torch

    import models
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.engine.partitioned import ParameterNotGatheredError

    model = models.make_model("gpt2")
    reference = copy.deepcopy(model)
    engine = shard_model(model, torch.optim.SGD(model.parameters(), lr=0.1), ZeroConfig(stage=3))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (x,) = models.make_batches(1, 1)[0]
    engine.backward(model(input_ids=x, labels=x).loss)
    engine.optimizer.step()
    reference(input_ids=x, labels=x).loss.backward()
    ref_opt.step()

    units = engine.gatherer.units
    assert all(u.state.sharded for u in units) and engine.memory_stats()["gathered_params"] == 0
    with pytest.raises(ParameterNotGatheredError):
        model.lm_head.weight.sum()
    with engine.gathered_parameters():
        assert all(u.state.gathered for u in units)
        assert engine.memory_stats()["gathered_params"] >= 4 * sum(p.numel() for p in reference.parameters())
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach().clone(), ref.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert all(u.state.sharded for u in units)


# ------------------------------------------------------------------ hpZ's after-forward state and the training state
def test_hpz_keeps_slices_after_forward_until_dropped():
    """SHARDED_POST_FORWARD: released with hpZ's slices kept; a gather from them keeps them (a second forward or
    the backward), a release after it goes back to SHARDED_POST_FORWARD, dropping them makes the unit SHARDED; the
    slices are stale once a shard version changes."""
    import torch

    st = UnitState()
    st.to_gathering([1])
    st.to_gathered()
    slices = [torch.zeros(2)]
    st.to_sharded(slices)
    assert st.value is ShardedState.SHARDED_POST_FORWARD and st.sharded and st.kept is slices
    assert not st.kept_stale([1]) and st.kept_stale([2])
    st.to_gathering([1])  # the backward's gather, inside the host
    st.to_gathered()
    st.to_sharded([torch.ones(2)])  # slices kept before stay: the first cut is what the backward reads
    assert st.value is ShardedState.SHARDED_POST_FORWARD and st.kept is slices
    assert st.drop_kept() is slices and st.value is ShardedState.SHARDED and st.kept is None
    with pytest.raises(AssertionError):
        st.to_sharded()  # released twice


def test_training_state_counts_decide_the_release_after_backward():
    st = UnitState()
    st.start_forward()
    assert st.training is TrainingState.FORWARD
    st.end_forward()
    st.forwards_pending = 2
    st.start_backward(trainable_groups=1)
    st.start_backward(trainable_groups=5)  # a recomputation inside the backward changes nothing
    assert st.in_backward and st.groups_pending == 1 and not st.backward_done()
    st.groups_pending -= 1
    st.forwards_pending -= 1
    assert not st.backward_done()  # one forward's inputs still wait for gradients
    st.forwards_pending -= 1
    assert st.backward_done()
    st.end_backward()
    assert st.training is TrainingState.IDLE and not st.backward_done()


# ------------------------------------------------------------------ the reshard_after_forward policy (pure planning)
@pytest.mark.parametrize("policy,want", [("auto", [False, True, False]), (True, [False, True, True]),
                                         (False, [False, False, False]), (2, [False, True, True])])
def test_reshard_policy_per_unit(policy, want):
    """The root never reshards; "auto" (torchtitan's default) keeps the last block too; True and K reshard every
    block; False none."""
    import models
    from hf_zero import ZeroConfig
    from hf_zero.engine.planning import plan_model

    plan = plan_model(models.make_model("gpt2"), 2, ZeroConfig(stage=3, reshard_after_forward=policy))
    assert [u.name for u in plan.units] == ["", "transformer.h.0", "transformer.h.1"]
    assert [u.reshard_after_forward for u in plan.units] == want


def test_reshard_overrides_by_class_and_by_name_and_refused_names():
    import models
    from hf_zero import ZeroConfig, ZeroConfigError
    from hf_zero.engine.planning import plan_model

    model = models.make_model("llama")
    by_class = ZeroConfig(stage=3, reshard_after_forward_modules={"LlamaDecoderLayer": False})
    assert [u.reshard_after_forward for u in plan_model(model, 2, by_class).units] == [False, False, False]
    both = ZeroConfig(stage=3, reshard_after_forward_modules={"LlamaDecoderLayer": False, "model.layers.1": True})
    assert [u.reshard_after_forward for u in plan_model(model, 2, both).units] == [False, False, True]
    with pytest.raises(ZeroConfigError, match=r"names \['model.layer.1'\], which are no stage-3 units"):
        plan_model(model, 2, ZeroConfig(stage=3, reshard_after_forward_modules={"model.layer.1": True}))
    with pytest.raises(ZeroConfigError, match="stage 3's policy"):
        ZeroConfig(stage=2, reshard_after_forward=False)
    with pytest.raises(ZeroConfigError, match="hpz_partition_size=4: give one of them"):
        ZeroConfig(stage=3, reshard_after_forward=2, hpz_partition_size=4)
    with pytest.raises(ZeroConfigError, match="allowed"):
        ZeroConfig(stage=3, reshard_after_forward=1)
    assert ZeroConfig(stage=3, reshard_after_forward=2).hpz_size == 2


# ------------------------------------------------------------------ the states a real step walks through
class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, h):
        return torch.tanh(self.lin(h))


class Stack(torch.nn.Module):
    """Root (input and output layers) around three blocks; `checkpoint_call`: each block's __call__ runs inside a
    reentrant checkpoint (user code), so its hooks run again in the backward's recomputation."""

    def __init__(self, d=6, checkpoint_call=False):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, 1)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(3))
        self.checkpoint_call = checkpoint_call

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=True) if self.checkpoint_call else b(h)
        return self.out(h).pow(2).mean()


def _walk(policy, checkpoint_call):
    """One process, stage 3: every unit's state after the forward and after the backward of two steps, and the
    final weights beside plain training with the same SGD steps."""
    import copy

    from hf_zero import ZeroConfig, shard_model

    torch.manual_seed(0)
    model = Stack(checkpoint_call=checkpoint_call)
    reference = copy.deepcopy(model)
    engine = shard_model(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         ZeroConfig(stage=3, units=["Block"], reshard_after_forward=policy))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    units = engine.gatherer.units
    seen = []
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step), requires_grad=checkpoint_call)
        loss = model(x)
        seen.append([(u.state.value, u.state.training) for u in units])
        engine.backward(loss)
        seen.append([(u.state.value, u.state.training) for u in units])
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        reference(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with engine.gathered_parameters():
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach().clone(), ref.detach(), rtol=1e-6, atol=1e-7, msg=name)
    return seen


@pytest.mark.parametrize("checkpoint_call", [False, True])
def test_a_step_walks_the_states_each_policy_says(checkpoint_call):
    """After the forward: the root gathered, each block sharded or gathered as its policy says, all IDLE; after the
    backward every unit SHARDED and IDLE again, and the weights are plain training's; also with a reentrant
    checkpoint around each block's __call__, whose recomputation runs the hooks inside the backward."""
    S, G, IDLE = ShardedState.SHARDED, ShardedState.GATHERED, TrainingState.IDLE
    for policy, after_forward in (("auto", [G, S, S, G]), (True, [G, S, S, S]), (False, [G, G, G, G])):
        if checkpoint_call:  # a reentrant checkpoint runs the forward without grad: nothing to keep for a backward
            after_forward = [G, S, S, S]
        seen = _walk(policy, checkpoint_call)
        for i, states in enumerate(seen):
            want = after_forward if i % 2 == 0 else [S, S, S, S]
            assert states == [(w, IDLE) for w in want], (policy, i, states)
