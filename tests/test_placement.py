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
    """CPU offload keeps the master and optimizer states in host memory; the compute device is the rule's, which
    takes no offload setting: a meta model loading under NCCL computes on CUDA with or without offload."""
    import inspect

    assert "offload" not in inspect.signature(compute_device).parameters
    assert compute_device(MIXED, META, loading=True, cuda_available=True) == CUDA0


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
