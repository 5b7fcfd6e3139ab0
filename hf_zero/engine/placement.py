"""Which device the engine computes on, when the caller does not say (`shard_model(device=None)`).

The facts are the group's backend per device type (`dist.get_backend_config`: "cpu:gloo,cuda:nccl" from
`init_process_group()` without a backend on a CUDA build, "cpu:gloo,cuda:gloo" for "gloo", "cuda:nccl" for
"nccl"; `dist.get_backend` says "undefined" for the first, so it is not read), whether CUDA is there, and where the
model's parameters are. The rule:

- a model already on a device stays there if the group runs collectives for that device type (a CUDA model
  under gloo too); otherwise (a CPU model under "nccl") it goes to the current CUDA device;
- a model on the meta device, loading into shards, goes to the current CUDA device when CUDA is there and the
  group runs CUDA collectives on something other than gloo (NCCL's "cpu:gloo,cuda:nccl" included), else to the
  CPU (gloo is how a run says "train on the CPU": ACCELERATE_USE_CPU, the tests);
- no process group: the parameters' device, or the CPU.

CPU offload does not enter: it moves the master and the optimizer states (and with offload_params the shards)
to host memory, and the compute device stays what this rule says.
"""
from __future__ import annotations

from typing import Optional

import torch

from .collectives import backend_map

__all__ = ["compute_device"]


def compute_device(backend_config: Optional[str], param_device: Optional[torch.device], loading: bool,
                   cuda_available: bool, current_cuda: int = 0) -> torch.device:
    """The device to compute on (see the module's rule). `backend_config`: None without a process group;
    `param_device`: the first parameter's device (None for a model without parameters)."""
    runs = backend_map(backend_config)
    cuda = torch.device("cuda", current_cuda)
    if param_device is not None and param_device.type == "meta":
        if not loading:
            raise ValueError("the model is on the meta device and shard_model() got no weights: pass "
                             "weights='folder_or_file.safetensors', or build it with hf_zero.from_pretrained")
        if cuda_available and runs.get("cuda", "gloo") != "gloo":
            return cuda
        return torch.device("cpu")
    if param_device is None:
        return cuda if cuda_available and runs and "cpu" not in runs else torch.device("cpu")
    if runs and param_device.type not in runs and cuda_available and "cuda" in runs:
        return cuda
    return param_device
