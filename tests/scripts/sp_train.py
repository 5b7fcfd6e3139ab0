"""Worker for tests/test_sequence_parallel.py: train a tiny HF causal LM with HfZeroAccelerator under Ulysses
sequence parallelism (torchrun: every rank runs this), one case after another in one process group.

argv: OUT CASES_JSON. Each case: {"name", "kind", "stage", "sp", "data", "plugin" (more ZeroPlugin options), "via"
("parallelism_config": sp given as Accelerate's ParallelismConfig(sp_size) instead of the plugin's option)}.
Writes OUT/<name>.rank<R>.json (the loss every micro-batch printed on this rank, the gradient norm of every step,
what an evaluation loop gathered with gather_for_metrics)
and, on the main process, OUT/<name>.safetensors (the final weights).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_zero  # noqa: F401,E402  (first: the Accelerate state is a gloo world on CPU)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import sp_cases  # noqa: E402
from hf_zero import HfZeroAccelerator, ZeroPlugin  # noqa: E402


def run(case, out):
    via_accelerate = case.get("via") == "parallelism_config"  # Accelerate's ParallelismConfig(sp_size) instead
    plugin = ZeroPlugin(stage=case["stage"], sequence_parallel_size=1 if via_accelerate else case["sp"],
                        reduce_bucket_size=4096, allgather_bucket_size=4096, **case.get("plugin", {}))
    extra = {}
    if via_accelerate:
        from accelerate.parallelism_config import ParallelismConfig

        extra["parallelism_config"] = ParallelismConfig(sp_size=case["sp"])
    accelerator = HfZeroAccelerator(zero_plugin=plugin, **extra,
                                    gradient_accumulation_steps=sp_cases.ACCUM)
    model = sp_cases.make_model(case["kind"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=sp_cases.LR)
    loader = sp_cases.loader(case["data"], accelerator.sequence_groups.data_parallel_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses, norms = [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            losses.append(loss.item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), sp_cases.MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
    # evaluation, as Accelerate's examples write it: every sample's inputs and its batch's loss gathered once
    evaluation = {"ids": [], "losses": [], "first_tokens": []}
    model.eval()
    with torch.no_grad():
        for batch in accelerator.prepare_data_loader(
                sp_cases.eval_loader(case["data"], accelerator.sequence_groups.data_parallel_size)):
            loss = model(**batch).loss
            evaluation["ids"] += accelerator.gather_for_metrics(batch["input_ids"]).tolist()
            evaluation["losses"] += accelerator.gather_for_metrics(loss.repeat(len(batch["input_ids"]))).tolist()
            evaluation["first_tokens"] += accelerator.gather_for_metrics(batch["input_ids"][:, 0].tolist(),
                                                                         use_gather_object=True)
    model.train()
    state = accelerator.get_state_dict(model)
    name = case["name"]
    with open(os.path.join(out, f"{name}.rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "dp_rank": accelerator.sequence_groups.data_parallel_rank,
                   "eval": evaluation}, f)
    if accelerator.is_main_process:
        save_file({k: v.detach().clone() for k, v in state.items()}, os.path.join(out, f"{name}.safetensors"))
    accelerator.wait_for_everyone()
    accelerator.free_memory()


if __name__ == "__main__":
    for case in json.loads(sys.argv[2]):
        run(case, sys.argv[1])
