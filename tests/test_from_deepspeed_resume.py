"""A DeepSpeed run resumed on hf_zero at another world size and stage continues exactly as DeepSpeed would.

Stock Accelerate + DeepSpeed ZeRO (2 CPU ranks, torch AdamW, clipping 1.0, a LambdaLR) trains a tiny Llama 2 steps
and saves (`save_state`); then (a) DeepSpeed resumes that folder and runs 2 more steps, (b) HfZeroAccelerator on 3
ranks loads the same folder and runs the same 2 global batches. The references are DeepSpeed's: its losses and its
own `zero_to_fp32` consolidation of its final state. Each run is its own processes (tests/scripts/foreign_resume.py,
a FileStore, no port); DeepSpeed is never imported in this process.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "foreign_resume.py")
pytestmark = [pytest.mark.slow, pytest.mark.needs_deepspeed]  # CI fails a skip: tests/conftest.py


def _needs_deepspeed():
    from hf_zero.tools.bench.deepspeed import unavailable_reason

    reason = unavailable_reason()  # in a subprocess: this process never imports DeepSpeed
    if reason is not None:
        pytest.skip(f"needs DeepSpeed to write real checkpoints (the `bench` extra): {reason}")


def _launch(tmp, world, *args):
    """`world` ranks of the script; their output in tmp/log.<rank>. Fails the test with rank 0's log tail."""
    backend = args[args.index("--backend") + 1]
    env = dict(os.environ, WORLD_SIZE=str(world), STORE=str(tmp / f"store.{len(os.listdir(tmp))}"),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    env.update({"ACCELERATE_USE_DEEPSPEED": "true"} if backend == "deepspeed" else
               {"ACCELERATE_USE_CPU": "1", "MASTER_ADDR": "127.0.0.1"})
    procs = []
    for rank in range(world):
        log = open(tmp / f"log.{backend}.{rank}", "w")
        procs.append((subprocess.Popen([sys.executable, SCRIPT, *args], env=dict(env, RANK=str(rank)),
                                       stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=600))
        finally:
            log.close()
    if any(codes):
        tail = (tmp / f"log.{backend}.0").read_text()[-3000:]
        pytest.fail(f"{backend} ranks exited with {codes}:\n{tail}")


@pytest.fixture(scope="module", params=[2, 3], ids=["deepspeed_zero2", "deepspeed_zero3"])
def deepspeed_run(request, tmp_path_factory):
    """A DeepSpeed folder saved after 2 steps, and DeepSpeed's own continuation of it (losses, final weights)."""
    _needs_deepspeed()
    stage = request.param
    groups = "1" if stage == 3 else "2"  # see foreign_resume.py: DeepSpeed's stage 3 under Accelerate
    tmp = tmp_path_factory.mktemp(f"ds{stage}")
    folder = tmp / "saved"
    _launch(tmp, 2, "--backend", "deepspeed", "--stage", str(stage), "--groups", groups, "--steps", "2",
            "--save", str(folder), "--out", str(tmp / "first.json"))
    _launch(tmp, 2, "--backend", "deepspeed", "--stage", str(stage), "--groups", groups, "--first", "2",
            "--steps", "2", "--load", str(folder), "--out", str(tmp / "continued.json"))
    return stage, groups, tmp, folder


@pytest.mark.parametrize("zero_stage", [3, 2])
def test_hf_zero_on_3_ranks_continues_a_deepspeed_run_as_deepspeed_does(deepspeed_run, zero_stage):
    ds_stage, groups, tmp, folder = deepspeed_run
    out = tmp / f"zero{zero_stage}.json"
    _launch(tmp, 3, "--backend", "zero", "--stage", str(zero_stage), "--groups", groups, "--first", "2",
            "--steps", "2", "--load", str(folder), "--out", str(out))
    ref, mine = json.loads((tmp / "continued.json").read_text()), json.loads(out.read_text())
    assert (f"hf_zero: found a DeepSpeed ZeRO-{ds_stage} checkpoint, 2 ranks, step 2 -> this run: stage "
            f"{zero_stage}, 3 ranks") in (tmp / "log.zero.0").read_text()
    assert mine["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=0)
    assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-12)  # the scheduler resumed where DeepSpeed's was
    ref_w = load_file(str(tmp / "continued.json.safetensors"))  # DeepSpeed's zero_to_fp32 of its final state
    mine_w = load_file(str(out) + ".safetensors")
    assert sorted(mine_w) == sorted(ref_w)
    for name in ref_w:
        torch.testing.assert_close(mine_w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)
    # and training moved the weights: the comparison is not of two copies of the saved state
    saved = load_file(str(tmp / "first.json.safetensors"))
    assert max((saved[n] - ref_w[n]).abs().max().item() for n in ref_w) > 1e-4


def _config_dir(tmp):
    """The writer's model config (tests/scripts/foreign_resume.py), as the folder beside a Trainer checkpoint."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    folder = tmp / "config"
    cfg.save_pretrained(folder)
    return folder


def test_consolidate_a_deepspeed_folder_equals_deepspeeds_own_zero_to_fp32(deepspeed_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_zero.cli import main

    _, _, tmp, folder = deepspeed_run
    out = tmp_path / "export"
    assert main(["consolidate", str(folder), str(out), "--config", str(_config_dir(tmp_path))]) == 0
    ref = load_file(str(tmp / "first.json.safetensors"))  # DeepSpeed's zero_to_fp32 of the saved state
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref[name]), name


def test_convert_writes_an_hf_zero_checkpoint_of_the_deepspeed_state(deepspeed_run, tmp_path):
    from hf_zero.checkpoint import export_pretrained, read_manifest
    from hf_zero.cli import main

    stage, _, tmp, folder = deepspeed_run
    dst = tmp_path / "converted"
    assert main(["convert", str(folder), str(dst)]) == 0
    manifest = read_manifest(dst)
    assert manifest["format"] == "hf_zero-sharded" and manifest["step"] == 2
    assert manifest["converted_from"]["description"] == f"a DeepSpeed ZeRO-{stage} checkpoint"
    assert manifest["optimizer"]["class"] == "AdamW"
    # DeepSpeed's LambdaLR(1 / (1 + s)) after 2 steps: lr 3e-3 / 3 in every group
    assert [g["lr"] for g in manifest["optimizer"]["param_groups"]] == pytest.approx([1e-3] * len(
        manifest["optimizer"]["param_groups"]))
    export_pretrained(dst, tmp_path / "export", progress=False)
    ref = load_file(str(tmp / "first.json.safetensors"))
    got = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    # converting again over the earlier conversion replaces it whole; a folder of other files is refused
    assert main(["convert", str(folder), str(dst)]) == 0
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["convert", str(folder), str(other)]) == 1
    assert [p.name for p in other.iterdir()] == ["keep.txt"]


def test_a_planted_payload_in_a_deepspeed_folder_does_not_run_on_resume(deepspeed_run, tmp_path):
    import shutil

    from test_foreign import _Payload, _plant, _snapshot

    _, groups, tmp, folder = deepspeed_run
    hostile = tmp_path / "hostile"
    shutil.copytree(folder, hostile)
    marker = tmp_path / "ran"
    _plant(str(hostile / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
           {"optimizer_state_dict": _Payload(f"touch {marker}")})
    before = _snapshot(str(hostile))
    with pytest.raises(pytest.fail.Exception, match=r"(?s)zero_pp_rank_1_mp_rank_00_optim_states\.pt: refused to "
                                                    r"unpickle.*system.*trust_pickles=True"):
        _launch(tmp_path, 3, "--backend", "zero", "--stage", "3", "--groups", groups, "--first", "2", "--steps", "1",
                "--load", str(hostile), "--out", str(tmp_path / "never.json"))
    assert not marker.exists() and _snapshot(str(hostile)) == before
    assert not (tmp_path / "never.json").exists()


def _trainer_checkpoint(folder, tmp_path):
    """The Trainer's layout of a DeepSpeed checkpoint: checkpoint-2/ with DeepSpeed's global_step2/ and `latest`,
    trainer_state.json (the Trainer's own TrainerState) and scheduler.pt. DeepSpeed's part is the real folder's;
    Accelerate's scheduler.bin is the same torch.save of the scheduler's state_dict the Trainer writes."""
    import shutil

    from transformers import TrainerState

    ckpt = tmp_path / "out" / "checkpoint-2"
    shutil.copytree(folder / "pytorch_model", ckpt / "global_step2")
    (ckpt / "latest").write_text("global_step2")
    shutil.copy(folder / "scheduler.bin", ckpt / "scheduler.pt")
    TrainerState(global_step=2, max_steps=4, logging_steps=1, train_batch_size=3).save_to_json(
        str(ckpt / "trainer_state.json"))
    return ckpt


def test_zero_trainer_resumes_a_deepspeed_trainer_checkpoint_as_deepspeed_continues(deepspeed_run, tmp_path):
    _, groups, tmp, folder = deepspeed_run
    ckpt = _trainer_checkpoint(folder, tmp_path)
    out = tmp_path / "trainer.json"
    _launch(tmp_path, 3, "--backend", "trainer", "--stage", "3", "--groups", groups, "--first", "2", "--steps", "2",
            "--load", str(ckpt), "--out", str(out))
    ref, mine = json.loads((tmp / "continued.json").read_text()), json.loads(out.read_text())
    assert mine["losses"] == pytest.approx(ref["losses"], abs=1e-4)  # the Trainer logs 4 decimals
    assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-12)
    ref_w, mine_w = load_file(str(tmp / "continued.json.safetensors")), load_file(str(out) + ".safetensors")
    assert sorted(mine_w) == sorted(ref_w)
    for name in ref_w:
        torch.testing.assert_close(mine_w[name], ref_w[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_3_rank_deepspeed_folder_with_padding_reads_as_deepspeeds_zero_to_fp32(stage, tmp_path):
    """3 ranks split this model's parameters unevenly (stage 3: per parameter; stage 1: the flat group), so
    partitions are padded: every parameter must still read back as DeepSpeed's own consolidation gives it. bf16
    at stage 1: the fp32 master is read, not the bf16 weights."""
    from hf_zero.checkpoint.open_foreign import open_foreign

    _needs_deepspeed()
    folder = tmp_path / "saved"
    _launch(tmp_path, 3, "--backend", "deepspeed", "--stage", str(stage), "--groups", "1" if stage == 3 else "2",
            "--steps", "1", "--save", str(folder), "--out", str(tmp_path / "first.json"),
            *(["--bf16"] if stage == 1 else []))
    ref = load_file(str(tmp_path / "first.json.safetensors"))
    src = open_foreign(str(folder))
    assert src.description == f"a DeepSpeed ZeRO-{stage} checkpoint" and src.m["world_size"] == 3
    assert src.m["step"] == 1
    assert sorted(p.name for p in src.params) == sorted(ref)
    padded = [p.name for p in src.params if p.numel % 3]
    assert padded  # the case this test is about
    for p in src.params:
        assert torch.equal(src.read(p.name, "values", 0, p.numel).view(p.shape), ref[p.name]), p.name
        lo, hi = p.numel // 3 + 1, p.numel - 1  # a range that crosses a partition boundary
        assert torch.equal(src.read(p.name, "values", lo, hi), ref[p.name].reshape(-1)[lo:hi]), p.name
        assert src.scalar(p.name, "step") == 1.0


def test_a_deepspeed_folder_of_another_model_is_refused_naming_the_parameters(deepspeed_run, tmp_path):
    _, groups, tmp, folder = deepspeed_run
    with pytest.raises(pytest.fail.Exception, match=r"(?s)was saved from another model.*shape mismatches.*"
                                                    r"model\.embed_tokens\.weight: saved \[64, 16\] vs model \[64, 32\]"):
        _launch(tmp_path, 2, "--backend", "zero", "--stage", "2", "--groups", groups, "--hidden", "32", "--first",
                "2", "--steps", "1", "--load", str(folder), "--out", str(tmp_path / "never.json"))
    assert not (tmp_path / "never.json").exists()
