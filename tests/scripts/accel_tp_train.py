"""HfZeroAccelerator on 2 data-parallel x 2 tensor-parallel ranks, taking both groups from the device mesh.

Accelerate builds its "dp"/"tp" mesh only on accelerators (its ParallelismConfig refuses MULTI_CPU), so this
script builds the same mesh with torch's init_device_mesh and hands it to the Accelerator state, where Accelerate
keeps its own. The model is test_zero_r's Megatron-style stack; rank 0 and 1 write their TP shard's final weights.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import test_zero_r as T  # noqa: E402

from hf_zero import HfZeroAccelerator, ZeroPlugin  # noqa: E402

out = sys.argv[1]
accelerator = HfZeroAccelerator(zero_plugin=ZeroPlugin(stage=2, activation_checkpointing="partitioned"))
rank = accelerator.process_index
mesh = init_device_mesh("cpu", (2, T.TP), mesh_dim_names=("dp", "tp"))
accelerator.state.device_mesh = mesh
t, d = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
dense = T.dense_model()
model = T.TPModel(mesh["tp"].get_group(), T.TP)
with torch.no_grad():
    for (name, p), q in zip(model.named_parameters(), dense.parameters()):
        p.copy_(T.tp_slice(name, q, t))
optimizer = T._tp_optimizer(model)
model, optimizer = accelerator.prepare(model, optimizer)
engine = accelerator.zero_engines[0]
store = model.blocks[0]._gradient_checkpointing_func.keywords["store"]
losses = []
for step in T.tp_batches():
    total = 0.0
    for mb in step:
        x = mb[d * (T.TP_ROWS // 2):(d + 1) * (T.TP_ROWS // 2)]
        loss = model(x)
        accelerator.backward(loss / T.TP_ACCUM)
        total += loss.item() / T.TP_ACCUM
    optimizer.step()
    optimizer.zero_grad()
    losses.append(total)
state = accelerator.get_state_dict(model)  # collective over the data-parallel group; full on its rank 0
report = {"rank": rank, "tp": t, "dp": d, "losses": losses,
          "zero_group": dist.get_process_group_ranks(engine.comm.group),
          "checkpoint_group": dist.get_process_group_ranks(store.group)}
os.makedirs(out, exist_ok=True)
json.dump(report, open(os.path.join(out, f"rank{rank}.json"), "w"))
if d == 0:
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out, f"tp{t}.safetensors"))
accelerator.end_training()
if dist.is_initialized():
    dist.destroy_process_group()
os._exit(0)
