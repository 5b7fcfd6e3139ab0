"""Foreign checkpoint folders (checkpoint/foreign.py): DeepSpeed ZeRO and torch.distributed.checkpoint, recognized
and read with no code run from them.

Real folders: DCP written by `torch.distributed.checkpoint.save` in this process; DeepSpeed written by DeepSpeed
itself (stage 3, one CPU rank, in a subprocess: DeepSpeed is never imported here). Hostile copies: a pickle payload
planted in each kind of file (it must not run: a marker file it would create stays absent, and the error names the
class and the file), a traversal in DeepSpeed's `latest`, truncated files, a missing data file.
"""
import io
import os
import pickle
import shutil
import socket
import subprocess
import sys
import zipfile

import pytest
import torch
from torch import nn

from hf_zero.checkpoint import CheckpointError
from hf_zero.checkpoint.foreign import ZeroStage, inspect_foreign, read_dcp_metadata, read_deepspeed_file
from hf_zero.checkpoint.pickles import UntrustedPickleError


class _Payload:
    """Unpickling this runs `os.system(command)`: what a hostile folder would plant."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _snapshot(folder):
    return {os.path.join(d, n): open(os.path.join(d, n), "rb").read() for d, _, names in os.walk(folder) for n in names}


# ------------------------------------------------------------------------------------------ DCP
@pytest.fixture()
def dcp_folder(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    folder = tmp_path / "dcp"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(folder))
    return str(folder), model


def test_dcp_folder_is_recognized_and_its_metadata_read(dcp_folder):
    folder, model = dcp_folder
    found = inspect_foreign(folder)
    assert found.kind == "dcp" and found.files == sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))
    assert found.describe().startswith("torch.distributed.checkpoint (DCP) checkpoint, written by 1 rank")
    meta = read_dcp_metadata(folder)
    assert tuple(meta.state_dict_metadata["model.weight"].size) == tuple(model.weight.shape)  # the real one's shape


def test_dcp_metadata_with_a_payload_does_not_run_it(dcp_folder, tmp_path):
    folder, _ = dcp_folder
    marker = tmp_path / "ran"
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump({"x": _Payload(f"touch {marker}")}, f)
    before = _snapshot(folder)
    with pytest.raises(UntrustedPickleError, match=r"\.metadata: refused.*(posix|os)\.system.*trust_pickles=True"):
        inspect_foreign(folder)
    assert not marker.exists() and _snapshot(folder) == before


def test_dcp_truncated_metadata_and_missing_data_are_named(dcp_folder):
    folder, _ = dcp_folder
    data_file = next(n for n in os.listdir(folder) if n.endswith(".distcp"))
    os.remove(os.path.join(folder, data_file))
    with pytest.raises(CheckpointError, match=f"DCP checkpoint without.*{data_file}"):
        inspect_foreign(folder)
    path = os.path.join(folder, ".metadata")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable DCP metadata file"):
        inspect_foreign(folder)


def test_a_folder_that_is_neither_is_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert inspect_foreign(str(tmp_path)) is None


# ------------------------------------------------------------------------------------------ DeepSpeed
WRITER = r'''
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1)
import deepspeed
from transformers import LlamaConfig, AutoModelForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
model = AutoModelForCausalLM.from_config(cfg)
shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
for step in range(2):
    x = torch.randint(0, 64, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
engine.save_checkpoint(sys.argv[1])
torch.save(shapes, os.path.join(sys.argv[1], "shapes.pt"))
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def deepspeed_folder(tmp_path_factory):
    from hf_zero.tools.bench.deepspeed import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs DeepSpeed to write a real checkpoint: {reason}")
    folder = tmp_path_factory.mktemp("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")
    done = subprocess.run([sys.executable, "-c", WRITER, str(folder / "ckpt")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return str(folder / "ckpt")


def _copy(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.slow
@pytest.mark.needs_deepspeed
def test_deepspeed_folder_is_recognized_and_read_without_deepspeed(deepspeed_folder):
    found = inspect_foreign(deepspeed_folder)
    assert found.describe() == "DeepSpeed ZeRO-3 checkpoint, 1 rank, step 2"
    step = os.path.join(deepspeed_folder, "global_step2")
    optim = read_deepspeed_file(os.path.join(step, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    inner = optim["optimizer_state_dict"]
    assert isinstance(inner["zero_stage"], ZeroStage) and inner["zero_stage"] == 3
    assert inner["loss_scaler"].deepspeed_class == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    model_states = read_deepspeed_file(os.path.join(step, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
    shapes = torch.load(os.path.join(deepspeed_folder, "shapes.pt"))  # the writer's own model, not the folder's
    recorded = {n: tuple(s) for group in model_states["param_shapes"] for n, s in group.items()}
    assert recorded == shapes
    flat = sum(t.numel() for t in inner["fp32_flat_groups"])
    assert flat == sum(torch.Size(s).numel() for s in shapes.values())  # one rank: no padding
    assert type(inner["loss_scaler"]).__module__ == "hf_zero.checkpoint.foreign"  # the record, not DeepSpeed's class


def _plant(pt_file, payload):
    """Replace the pickle inside a torch zip file with `payload` (the storages stay)."""
    with zipfile.ZipFile(pt_file) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    key = next(n for n in entries if n.endswith("data.pkl"))
    buf = io.BytesIO()
    pickle.dump(payload, buf, protocol=2)
    entries[key] = buf.getvalue()
    with zipfile.ZipFile(pt_file, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data)


@pytest.mark.slow
@pytest.mark.needs_deepspeed
def test_deepspeed_file_with_a_payload_does_not_run_it(deepspeed_folder, tmp_path):
    folder = _copy(deepspeed_folder, tmp_path)
    marker = tmp_path / "ran"
    target = os.path.join(folder, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    _plant(target, {"optimizer_state_dict": _Payload(f"touch {marker}")})
    before = _snapshot(folder)
    with pytest.raises(UntrustedPickleError, match=r"optim_states\.pt: refused.*system.*trust_pickles=True"):
        inspect_foreign(folder)
    assert not marker.exists() and _snapshot(folder) == before


@pytest.mark.slow
@pytest.mark.needs_deepspeed
def test_deepspeed_latest_naming_a_folder_outside_is_refused(deepspeed_folder, tmp_path):
    folder = _copy(deepspeed_folder, tmp_path)
    with open(os.path.join(folder, "latest"), "w") as f:
        f.write("../../etc")
    with pytest.raises(CheckpointError, match=r"latest names '../../etc', not a folder inside"):
        inspect_foreign(folder)


@pytest.mark.slow
@pytest.mark.needs_deepspeed
def test_deepspeed_truncated_file_is_named(deepspeed_folder, tmp_path):
    folder = _copy(deepspeed_folder, tmp_path)
    target = os.path.join(folder, "global_step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    data = open(target, "rb").read()
    with open(target, "wb") as f:
        f.write(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match=r"optim_states\.pt: not a readable DeepSpeed checkpoint file"):
        inspect_foreign(folder)


@pytest.mark.slow
@pytest.mark.needs_deepspeed
def test_reading_and_exporting_a_deepspeed_folder_never_imports_deepspeed(deepspeed_folder, tmp_path):
    """In a fresh interpreter (DeepSpeed is installed here): hf_zero's checkpoint layer opens, reads and exports a
    DeepSpeed folder, and `deepspeed` is still not in sys.modules."""
    code = (
        "import sys, torch\n"
        "from hf_zero.checkpoint.open_foreign import open_foreign\n"
        "from hf_zero.checkpoint import export_pretrained\n"
        f"src = open_foreign({deepspeed_folder!r})\n"
        "p = src.params[0]\n"
        "assert src.read(p.name, 'values', 0, p.numel).numel() == p.numel\n"
        f"export_pretrained({deepspeed_folder!r}, {str(tmp_path / 'out')!r}, progress=False)\n"
        "print('deepspeed' in sys.modules, sorted(m for m in sys.modules if m.startswith('deepspeed'))[:3])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False []"
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_model_parallel_deepspeed_folder_is_refused_by_name(tmp_path):
    """Files of two model-parallel ranks (Megatron-style tensor parallelism): named as such, before any is read."""
    step = tmp_path / "global_step3"
    step.mkdir()
    (tmp_path / "latest").write_text("global_step3")
    for dp in (0, 1):
        for mp in (0, 1):
            (step / f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"2 model-parallel ranks \(mp_rank \[0, 1\]\).*data-parallel ZeRO"):
        inspect_foreign(str(tmp_path))
