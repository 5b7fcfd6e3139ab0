"""A stage-3 unit's one gather state (engine/unit_state.py): the transitions, the staleness of a gather made before
a step, and that the unit's flat groups answer "gathered?" from it. Pure logic: no process group."""
import pytest

from hf_zero.engine.unit_state import GatherState, UnitState


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
