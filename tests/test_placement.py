"""The engine's choice of compute device (engine/placement.py) under every backend string torch hands out, without
a GPU: the facts (backend config, CUDA there or not, the parameters' device) are given to the pure rule; the last
tests read the facts from real process groups on this machine (gloo, torch's default, fake)."""
import pytest
import torch
import torch.distributed as dist

from hf_zero.engine.placement import compute_device

CPU, META, CUDA0, CUDA1 = torch.device("cpu"), torch.device("meta"), torch.device("cuda", 0), torch.device("cuda", 1)

# (backend config as dist.get_backend_config says it, what init_process_group was given)
NCCL = "cuda:nccl"  # init_process_group("nccl")
MIXED = "cpu:gloo,cuda:nccl"  # init_process_group() on a CUDA build: get_backend() says "undefined"
GLOO = "cpu:gloo,cuda:gloo"  # init_process_group("gloo"): CPU and CUDA tensors both on gloo
CPU_DEFAULT = "cpu:gloo"  # init_process_group() on a CPU-only build


@pytest.mark.parametrize("backend", [NCCL, MIXED, "nccl"])
def test_meta_model_loading_into_shards_lands_on_the_current_cuda_device(backend):
    # the bug this fixes: under "cpu:gloo,cuda:nccl" a from_pretrained model landed on the CPU
    assert compute_device(backend, META, loading=True, cuda_available=True, current_cuda=1) == CUDA1


@pytest.mark.parametrize("backend", [GLOO, CPU_DEFAULT, "gloo", None])
def test_meta_model_under_gloo_or_alone_lands_on_the_cpu(backend):
    assert compute_device(backend, META, loading=True, cuda_available=True, current_cuda=1) == CPU


@pytest.mark.parametrize("backend", [NCCL, MIXED, GLOO, None])
def test_meta_model_without_a_gpu_lands_on_the_cpu(backend):
    assert compute_device(backend, META, loading=True, cuda_available=False) == CPU


@pytest.mark.parametrize("backend", [NCCL, MIXED, GLOO, CPU_DEFAULT, None])
def test_meta_model_without_weights_is_an_error_naming_the_fix(backend):
    with pytest.raises(ValueError, match="meta device.*weights="):
        compute_device(backend, META, loading=False, cuda_available=True)


@pytest.mark.parametrize("backend", [NCCL, MIXED, GLOO, None])
def test_a_cuda_model_stays_on_its_device(backend):
    # gloo with CUDA tensors included: the model was put there, and gloo runs CUDA collectives
    assert compute_device(backend, CUDA1, loading=False, cuda_available=True, current_cuda=0) == CUDA1


def test_a_cpu_model_under_nccl_moves_to_the_current_cuda_device():
    # NCCL has no CPU collectives: the old rule's one case, kept
    assert compute_device(NCCL, CPU, loading=False, cuda_available=True, current_cuda=1) == CUDA1
    assert compute_device("nccl", CPU, loading=False, cuda_available=True, current_cuda=0) == CUDA0


@pytest.mark.parametrize("backend", [MIXED, GLOO, CPU_DEFAULT, None])
def test_a_cpu_model_stays_on_the_cpu_where_the_group_runs_cpu_collectives(backend):
    assert compute_device(backend, CPU, loading=False, cuda_available=True) == CPU


def test_a_model_without_parameters():
    assert compute_device(NCCL, None, loading=False, cuda_available=True, current_cuda=1) == CUDA1
    assert compute_device(MIXED, None, loading=False, cuda_available=True) == CPU
    assert compute_device(None, None, loading=False, cuda_available=True) == CPU


def test_offload_does_not_move_the_compute_device():
    """The rule takes no offload setting: a meta model loading under NCCL computes on CUDA with or without offload
    (where offload puts each model state is checked on a real engine below)."""
    import inspect

    assert "offload" not in inspect.signature(compute_device).parameters


# ------------------------------------------------------------------------------------------ offload on an engine
N, RANK = 3, 1  # rank 1 of 3: a shard that starts inside the flat buffers, and padding (the counts are not 3k)
# (stage, offload_optimizer, offload_params, mixed_precision); the last is the control: nothing offloaded
OFFLOADS = [(3, "cpu", "cpu", "bf16"), (3, "cpu", "none", "no"), (2, "cpu", "none", "bf16"), (3, "none", "none", "no")]


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """The tests' tiny Llama written by save_pretrained, and its parameters (the reference values)."""
    import models

    model = models.make_model("llama")
    folder = tmp_path_factory.mktemp("placement")
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("stage,offload_optimizer,offload_params,mp", OFFLOADS)
def test_offload_places_each_model_state_where_the_config_says(saved_llama, stage, offload_optimizer,
                                                               offload_params, mp):
    """A meta model loaded into shards by shard_model(weights=...) as rank 1 of 3 (torch's `fake` backend: the
    collectives return at once, the other ranks are not there), then one backward and one step. Where each model
    state lands is what docs/offload.md and the config's help say, whatever the engine reports about itself:

    - the model's parameters: the compute device (the placement rule: a meta model loading
      under a backend that runs CUDA collectives on something other than gloo computes on the current GPU when
      there is one, else on the CPU); parameters in the compute dtype, gradients accumulated in fp32;
    - parameter shards: host memory with offload_params="cpu", else the compute device;
    - gradient shards (fp32): host memory with offload_optimizer="cpu" at stages 2/3, as ZeRO-Offload places them
      (pinned when the compute device is a GPU), else the compute device;
    - the fp32 master shard and Adam's exp_avg / exp_avg_sq: host memory with offload_optimizer="cpu" (the master a
      copy of its own, pinned when the compute device is a GPU), else the compute device; the optimizer steps views
      of the master (its segments share the master's storage);
    - the values loaded: the master is the rank's range of the flat fp32 weights of the saved files, counted here
      from the reference model (tests/_flat_layout.py), padding zero; the shard the same in the compute dtype;
    - memory_stats()["offloaded"]: the bytes of the host-resident states of the first-principles count.

    Without a GPU the compute device is the host too: there the devices catch a state left on meta or put on a
    wrong device, and the values, dtypes, pinning, views and byte counts do the rest; on a GPU machine (the
    `fake` backend names CUDA) the same test tells the compute device from host memory.
    """
    import models
    from _flat_layout import layout, state_bytes
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    import hf_zero
    from hf_zero import ZeroConfig, shard_model

    folder, reference = saved_llama
    host = CPU
    compute = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else CPU
    dtype = {"no": torch.float32, "bf16": torch.bfloat16}[mp]
    where = {"master": host if offload_optimizer == "cpu" else compute,
             "shard": host if offload_params == "cpu" else compute,
             "grads": host if offload_optimizer == "cpu" and stage >= 2 else compute}
    config = ZeroConfig(stage=stage, offload_optimizer=offload_optimizer, offload_params=offload_params,
                        mixed_precision=mp)
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=N)
    try:
        with hf_zero.parameters_on_meta():
            model = AutoModelForCausalLM.from_config(models._config("llama"), attn_implementation="eager")
        engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config, weights=folder)
        assert engine.device == compute
        # the loaded values, against the flat layout counted from the reference model
        ref = dict(reference.named_parameters())
        count = {tuple(s[0] for s in g.slots): g for g in layout(reference, N, None if mp == "no" else dtype)}
        assert len(count) == len(engine.groups)
        for g in engine.groups:
            c = count[tuple(s.name for s in g.plan.slots)]
            flat = torch.zeros(c.padded)
            for name, _, offset, numel in c.slots:
                flat[offset:offset + numel] = ref[name].detach().reshape(-1)
            lo, hi = RANK * c.shard, (RANK + 1) * c.shard
            assert g.shard.device == where["shard"] and g.shard.dtype == dtype, g.plan.index
            assert g.shard.is_pinned() == (g.shard.device == host != compute)  # async copies to a GPU
            assert torch.equal(g.shard.cpu(), flat[lo:hi].to(dtype)), f"group {g.plan.index}: shard values"
            if stage < 3:  # the whole flat compute buffer, the parameters' storage
                assert g.full.device == compute and torch.equal(g.full.cpu(), flat.to(dtype)), g.plan.index
            assert g.master.device == where["master"] and g.master.dtype == torch.float32
            assert torch.equal(g.master.cpu(), flat[lo:hi]), f"group {g.plan.index}: master values"
            if offload_optimizer == "cpu":
                assert g.master.data_ptr() != g.shard.data_ptr()  # its own host copy, the step's input and output
                assert g.master.is_pinned() == (compute.type == "cuda")
        # one micro-batch and the step (the fake collectives leave the gathered values undefined: placement only)
        ids = torch.randint(0, models.VOCAB, (2, 8), device=compute)
        engine.backward(model(input_ids=ids, labels=ids).loss)
        engine.optimizer.step()
        for name, p in model.named_parameters():
            assert p.device == compute and p.dtype == dtype, name
        masters = {g.master.untyped_storage().data_ptr() for g in engine.groups}
        for g in engine.groups:
            assert g.grad_shard.device == where["grads"] and g.grad_shard.dtype == torch.float32, g.plan.index
            assert g.grad_shard.numel() == g.plan.shard_numel
            assert g.grad_shard.is_pinned() == (where["grads"] == host != compute)  # async copies from a GPU
        states = 0
        for group in engine.optimizer.param_groups:
            for seg in group["params"]:
                assert seg.untyped_storage().data_ptr() in masters, "an optimizer segment is not a view of a master"
                st = engine.optimizer.state[seg]
                for key in ("exp_avg", "exp_avg_sq"):
                    assert st[key].device == where["master"] and st[key].dtype == torch.float32, key
                    assert st[key].shape == seg.shape
                states += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
        want = state_bytes(reference, N, stage, RANK, mixed_precision=mp)
        assert states == want["optimizer_states"]
        master = want["master"] if mp != "no" else (want["params"] if offload_optimizer == "cpu" else 0)
        offloaded = (master + want["optimizer_states"] + (want["grads"] if stage >= 2 else 0)
                     if offload_optimizer == "cpu" else 0) + (want["params"] if offload_params == "cpu" else 0)
        assert engine.memory_stats()["offloaded"] == offloaded
        engine.close()
    finally:
        dist.destroy_process_group()


def _init(backend, **kw):
    dist.init_process_group(backend, store=kw.pop("store", None) or dist.HashStore(), rank=0, world_size=1)


# torch's default backend names CUDA's only in a CUDA build (this CI's torch is the CPU build)
DEFAULT = MIXED if torch.cuda.is_available() else CPU_DEFAULT


@pytest.mark.parametrize("backend,expected", [("gloo", GLOO), (None, DEFAULT)])
def test_the_facts_come_from_get_backend_config(backend, expected):
    """The engine reads dist.get_backend_config, which names the device types; get_backend says "undefined" for
    torch's default (mixed) backend. On a GPU machine this is the real thing: a meta model loading under the
    default backend lands on the GPU, under gloo on the CPU."""
    from torch import nn

    from hf_zero.engine.engine import _default_device

    assert not dist.is_initialized()
    if backend is None:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)
    else:
        _init(backend)
    try:
        assert dist.get_backend_config() == expected
        with torch.device("meta"):
            model = nn.Linear(2, 2)
        on_gpu = torch.cuda.is_available() and expected == MIXED
        want = torch.device("cuda", torch.cuda.current_device()) if on_gpu else CPU
        assert _default_device(model, None, loading=True) == want
        assert _default_device(nn.Linear(2, 2), None, loading=False) == CPU
    finally:
        dist.destroy_process_group()
