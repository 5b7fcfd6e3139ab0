"""What `accelerate launch` will start from an Accelerate config file on this machine (`hf-zero config --show`
and the notes `hf-zero config` prints after writing). Accelerate 1.15 starts ONE process for a MULTI_CPU config
without mpirun, and the multi-GPU launcher does not pass `use_cpu` on to its ranks: this module says so before a
user finds out from a run that trained alone.

Accelerate and torch are imported inside the function: `hf-zero bench` builds the CLI parser too.
"""
from __future__ import annotations

import os
from typing import Any, List, Tuple

from ..options import BY_NAME


def distributed_type_name(config: Any) -> str:
    """The config's distributed_type as the string Accelerate writes in YAML ("MULTI_GPU", ...)."""
    value = config.distributed_type
    return getattr(value, "value", str(value))


MIXED_PRECISION: Tuple[str, ...] = BY_NAME["mixed_precision"].kind.values  # what hf_zero runs (not Accelerate's fp8)


def launch_plan(config_file: os.PathLike) -> Tuple[List[str], List[str]]:
    """What `accelerate launch --config_file config_file script.py` starts on this machine: (facts, problems).

    Uses Accelerate's own launch-argument resolution (`_validate_launch_command`), then its launcher choice."""
    import logging

    import torch
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser


    facts: List[str] = []
    problems: List[str] = []
    parser = launch_command_parser()
    ns = parser.parse_args(["--config_file", str(config_file), "script.py"])
    log = logging.getLogger("accelerate.commands.launch")
    level = log.level
    log.setLevel(logging.ERROR)  # its "defaults were used" warnings are about flags we did not pass on purpose
    try:
        ns, defaults, _ = _validate_launch_command(ns)
    finally:
        log.setLevel(level)
    n = int(ns.num_processes)
    machines = int(ns.num_machines or 1)
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    per_node = n // machines if machines > 1 else n
    where = f" on each of {machines} machines" if machines > 1 else ""
    if ns.use_deepspeed and not ns.cpu:
        facts.append(f"the DeepSpeed launcher with {n} processes")
        problems.append("distributed_type DEEPSPEED: Accelerate switches to DeepSpeed and HfZeroAccelerator refuses "
                        "to start; run `hf-zero config`")
    elif (ns.use_fsdp or ns.use_megatron_lm or ns.multi_gpu) and not ns.cpu:
        facts.append(f"{per_node} processes{where} (torchrun, Accelerate's multi-GPU launcher): one world of {n} ranks")
        if ns.use_fsdp or ns.use_megatron_lm:
            problems.append("FSDP / Megatron-LM selected: Accelerate switches backends and HfZeroAccelerator refuses "
                            "to start; run `hf-zero config`")
        if not cuda:
            facts.append("no GPU is visible here: HfZeroAccelerator runs the ranks on CPU with gloo. The launcher does "
                         "not pass use_cpu on to the ranks, so state built before HfZeroAccelerator (a plain "
                         "Accelerator, PartialState, TrainingArguments without use_cpu=True) sees 1 process: for such "
                         "scripts set TrainingArguments(use_cpu=True) or launch with ACCELERATE_USE_CPU=1")
        elif getattr(ns, "use_cpu", False):
            problems.append(f"use_cpu is set but this machine has {gpus} GPU(s): the multi-GPU launcher does not pass "
                            f"use_cpu to the ranks, so they will use the GPUs. For CPU ranks launch with "
                            f"ACCELERATE_USE_CPU=1 (or CUDA_VISIBLE_DEVICES=)")
        else:
            facts.append(f"the ranks use the GPUs (nccl); {gpus} visible")
            if per_node > gpus:
                problems.append(f"{per_node} processes per machine but only {gpus} GPU(s) visible here")
    elif ns.tpu and not ns.cpu:
        facts.append("the TPU launcher")
        problems.append("TPU/XLA is not supported by hf_zero")
    else:
        hostfile = getattr(ns, "mpirun_hostfile", None)
        if hostfile:
            facts.append(f"{n} processes through mpirun (hostfile {hostfile})")
        else:
            facts.append("ONE process (Accelerate's simple launcher)")
            if n > 1 or machines > 1:
                problems.append(f"the config says num_processes={n} but `accelerate launch` starts ONE process "
                                f"(distributed_type {distributed_type_name(defaults)} without mpirun). Rerun `hf-zero config`: it writes "
                                f"MULTI_GPU with use_cpu, which starts {n} gloo ranks on CPU")
        if cuda and not (getattr(ns, "use_cpu", False) or ns.cpu):
            facts.append("on a GPU")
        else:
            facts.append("on CPU")
    mp = ns.mixed_precision or "no"
    facts.append(f"mixed precision {mp} (HfZeroAccelerator: {mp} compute, fp32 master weights)"
                 if mp in ("bf16", "fp16") else f"mixed precision {mp}")
    if mp not in MIXED_PRECISION:
        problems.append(f"mixed_precision {mp!r}: hf_zero supports {', '.join(MIXED_PRECISION)}")
    return facts, problems
