"""Ulysses sequence parallelism (issue #44) under the Trainer, TRL and PEFT: ZeroTrainer, TRL's SFTTrainer with
packing (padding-free: position ids restart per document) and SFT with a PEFT LoRA adapter, with
ZeroPlugin(sequence_parallel_size=2), train exactly as the stock Trainer / SFTTrainer in one plain process on the
same data: the logged loss of every step, the grad norm (which AdamW and clipping alone would forgive a constant
factor in), the tokens seen, the samples per step, and the weights (or adapter) save_model writes. Both values of
`average_tokens_across_devices` (the Trainer's token count gathered over every rank, or each rank's own), stages 1-3,
W = 2 (sp = 2) and W = 4 (2 replicas x sp = 2, against one process reading both replicas' rows as one batch).

The evaluation loss on an eval set whose last batch is uneven is the stock one (each replica's losses gathered once).
A checkpoint saved at sp = 2 on 2 ranks resumes at sp = 1 on 2 ranks and on 1 rank: steps 3-4 and the final weights
are the stock run's. What cannot be right is refused with the fix: compute_loss_func, label smoothing,
compute_metrics (all get one chunk's logits), TRL's DPOTrainer (a whole-sequence objective from a chunk).

The hf_zero workers run under torchrun (a port the OS hands out), all cases of one world size in one launch; the
stock runs in one plain process that never imports hf_zero before them (tests/scripts/sp_trainer_train.py). The
quick tests check the collator padding hf_zero adds against Transformers' own loss, and the refusals' messages.
"""
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file
from test_sequence_parallel import _env  # the same clean launcher environment

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "sp_trainer_train.py")
SP = 2

# name -> (the stock run it must equal, the case); "ckpt" is filled in with the checkpoint's path
W2 = {
    "trainer_sp2": ("stock_trainer", dict(kind="trainer", stage=2, max_steps=4, save_steps=2, tokens=True,
                                          eval_rows=7)),
    "trainer_sp2_noavg": ("stock_trainer", dict(kind="trainer", stage=3, max_steps=4, avg=False, tokens=True,
                                                eval_rows=7)),
    "sft_sp2": ("stock_sft", dict(kind="sft", stage=1)),
    "sft_sp2_noavg": ("stock_sft", dict(kind="sft", stage=3, avg=False)),
    "sft_lora_sp2": ("stock_sft_lora", dict(kind="sft_lora", stage=2)),
    # the sp = 2 checkpoint on 2 ranks at sp = 1: 2 replicas of 1 row read what one replica of 2 rows read
    "resume_dp2": ("stock_trainer", dict(kind="trainer", stage=2, sp=1, batch=1, max_steps=4, tokens=True,
                                         resume="ckpt")),
}
W4 = {
    "trainer_dp2_sp2": ("stock_trainer_b4", dict(kind="trainer", stage=2, max_steps=4, tokens=True)),
    "sft_dp2_sp2": ("stock_sft", dict(kind="sft", stage=3, batch=1)),
}
REFUSED = {
    "refuse_compute_loss_func": (dict(kind="trainer", compute_loss_func=True), "ValueError: compute_loss_func",
                                 "leave compute_loss_func unset"),
    "refuse_label_smoothing": (dict(kind="trainer", label_smoothing=True), "ValueError: label smoothing",
                               "set label_smoothing_factor=0"),
    "refuse_compute_metrics": (dict(kind="trainer", compute_metrics=True), "ValueError: compute_metrics",
                               "leave compute_metrics unset"),
    "refuse_dpo": (dict(kind="dpo"), "NotImplementedError: ZeroDPOTrainer",
                   "runs the Trainer's own loss and TRL's SFTTrainer"),
}
STOCK = {
    "stock_trainer": dict(kind="trainer", max_steps=4, tokens=True, eval_rows=7),
    "stock_trainer_b4": dict(kind="trainer", batch=4, max_steps=4, tokens=True),
    "stock_sft": dict(kind="sft"),
    "stock_sft_lora": dict(kind="sft_lora"),
}
# after the stock runs, in the same plain process: the sp = 2 checkpoint on 1 rank
RESUME_W1 = ("stock_trainer", dict(kind="trainer", backend="zero", stage=2, sp=1, max_steps=4, tokens=True,
                                   resume="ckpt"))


def _cases(cases, out, **extra):
    """name -> case: the worker's list, with `extra` and the checkpoint's path filled in."""
    ckpt = str(out / "trainer_sp2.run" / "checkpoint-2")
    return [{**extra, **case, "name": name, **({"resume": ckpt} if case.get("resume") else {})}
            for name, case in cases.items()]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp_trainer")
    done = set()

    def launch(which):
        if which in done:
            return out
        if which == 1:  # the stock runs, then the resume of the W = 2 run's checkpoint on 1 rank
            launch(2)
            cases = _cases(STOCK, out) + _cases({"resume_w1": RESUME_W1[1]}, out)
            cmd = [sys.executable, SCRIPT, str(out), json.dumps(cases)]
        else:
            table = W2 if which == 2 else W4
            cases = _cases({name: case for name, (_, case) in table.items()}, out, backend="zero", sp=SP)
            if which == 2:  # last: a refused run stops between a forward and its backward
                cases += _cases({name: case for name, (case, _, _) in REFUSED.items()}, out, backend="zero", sp=SP,
                                refused=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(which),
                   SCRIPT, str(out), json.dumps(cases), "--zero"]
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900, cwd=str(out))
        assert res.returncode == 0, f"{' '.join(cmd[:6])} failed ({res.returncode}):\n{res.stdout[-3000:]}\n" \
                                    f"{res.stderr[-6000:]}"
        done.add(which)
        return out

    return launch


def _log(out, name):
    return json.load(open(out / f"{name}.json"))


def _batches(out, name, rank):
    return json.load(open(out / f"{name}.rank{rank}.batches.json"))


def _assert_same_run(got, want, steps=slice(None)):
    assert len(got["losses"]) == len(want["losses"]) > 0
    torch.testing.assert_close(torch.tensor(got["losses"][steps]), torch.tensor(want["losses"][steps]), rtol=1e-5,
                               atol=1e-6, msg=lambda m: f"logged losses: {m}")
    # AdamW and clipping forgive a gradient off by a constant (sp, say): the norm does not
    torch.testing.assert_close(torch.tensor(got["norms"][steps]), torch.tensor(want["norms"][steps]), rtol=1e-5,
                               atol=1e-6, msg=lambda m: f"grad norms: {m}")


def _assert_same_weights(ours, ref, file):
    a, b = load_file(ours / file), load_file(ref / file)
    assert set(a) == set(b) and a, sorted(set(a) ^ set(b))
    for key in a:
        # AdamW divides by the root of the second moment: summation-order noise in a near-zero gradient element
        # moves it by up to ~1e-5 of lr = 2e-2 (tests/test_sequence_parallel.py)
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=5e-5, msg=lambda m, k=key: f"{k}: {m}")


def _world(name):
    return 2 if name in W2 else 4


# ------------------------------------------------------------------------------------------ the Trainer
@pytest.mark.slow
@pytest.mark.parametrize("name", ["trainer_sp2", "trainer_sp2_noavg", "trainer_dp2_sp2"])
def test_zero_trainer_with_sequence_parallelism_matches_the_stock_trainer(launched, name):
    world = _world(name)
    out = launched(world)
    ref_name = (W2 if world == 2 else W4)[name][0]
    launched(1)
    ours, ref = _log(out, name), _log(out, ref_name)
    assert ours["world"] == world and ref["world"] == 1
    _assert_same_run(ours, ref)
    # tokens seen and samples per step count each replica's batch once, not once per sp rank
    assert ours["tokens_seen"] == ref["tokens_seen"] > 0
    assert ours["total_batch"] == ref["total_batch"]
    if world == 2:  # evaluation on 7 rows in batches of 2 (the last one uneven): the stock one-process loss
        assert ours["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    _assert_same_weights(out / name, out / ref_name, "model.safetensors")
    # the Trainer's dataloader is hf_zero's: the sp ranks of a replica read the same rows, the replicas distinct
    # ones, and together the rows the stock run read in one batch
    stock = _batches(out, ref_name, 0)
    ranks = [_batches(out, name, r) for r in range(world)]
    for replica in range(world // SP):
        assert ranks[replica * SP] == ranks[replica * SP + 1]
    rows = [sum((ranks[r][i]["rows"] for r in range(0, world, SP)), []) for i in range(len(stock))]
    assert rows == [b["rows"] for b in stock]


# ------------------------------------------------------------------------------------------ TRL and PEFT
@pytest.mark.slow
@pytest.mark.parametrize("name", ["sft_sp2", "sft_sp2_noavg", "sft_dp2_sp2", "sft_lora_sp2"])
def test_sft_packing_with_sequence_parallelism_matches_stock_trl(launched, name):
    """Packed rows of several documents (position ids restarting, no padding mask), concatenated per batch
    (padding-free): hf_zero pads them to a multiple of sp (labels -100, positions of their own); stock TRL does not."""
    world = _world(name)
    out = launched(world)
    ref_name = (W2 if world == 2 else W4)[name][0]
    launched(1)
    _assert_same_run(_log(out, name), _log(out, ref_name))
    if name.startswith("sft_lora"):  # the adapter in PEFT's layout, the base untouched
        _assert_same_weights(out / name, out / ref_name, "adapter_model.safetensors")
    else:
        _assert_same_weights(out / name, out / ref_name, "model.safetensors")
    stock = _batches(out, ref_name, 0)
    assert all(len(b["rows"]) == 1 for b in stock)  # padding-free: one row per batch
    assert any(b["shape"][1] % SP for b in stock)  # some packed lengths do not divide by sp in stock TRL
    ranks = [_batches(out, name, r) for r in range(world)]
    assert all(b["shape"][1] % SP == 0 for r in ranks for b in r)
    for replica in range(world // SP):
        assert ranks[replica * SP] == ranks[replica * SP + 1]
    if world == 4:
        assert ranks[0] != ranks[SP]
    # TRL's logged num_tokens (gathered with gather_for_metrics): every token the replicas read, once, not once per
    # sp rank; the count is of the rows as hf_zero padded them
    assert _log(out, name)["num_tokens"][-1] == sum(b["shape"][1] for r in range(0, world, SP) for b in ranks[r])


# ------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.slow
@pytest.mark.parametrize("name", ["resume_dp2", "resume_w1"])
def test_a_checkpoint_saved_at_sp2_resumes_at_sp1(launched, name):
    """trainer_sp2 saved checkpoint-2 (sp = 2, 2 ranks). Resumed at sp = 1 on 2 ranks (2 replicas of 1 row) or on
    1 rank, steps 3-4 and the final weights are the stock run's: the state does not depend on sp."""
    out = launched(1)
    ours, ref = _log(out, name), _log(out, "stock_trainer")
    assert ours["world"] == (2 if name == "resume_dp2" else 1)
    _assert_same_run(ours, ref, steps=slice(2, 4))  # steps 1-2 are the checkpoint's own log history
    assert ours["losses"][:2] == _log(out, "trainer_sp2")["losses"][:2]
    assert ours["tokens_seen"] == ref["tokens_seen"]
    _assert_same_weights(out / name, out / "stock_trainer", "model.safetensors")


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.slow
@pytest.mark.parametrize("name", list(REFUSED))
def test_what_cannot_be_right_is_refused_on_every_rank(launched, name):
    out = launched(2)
    _, starts, fix = REFUSED[name]
    for rank in range(2):
        said = open(out / f"{name}.rank{rank}.error.txt").read()
        assert said.startswith(starts) and fix in said, said


def test_parallelism_config_sp_is_refused_with_the_plugin_option_named():
    """The Trainer treats ParallelismConfig(sp_size) as DeepSpeed's ALST (its loss, its dataloader adapter). On CPU
    Accelerate itself refuses a ParallelismConfig before the Trainer exists, so the check is called directly."""
    from accelerate import ParallelismConfig

    from hf_zero.integrations.trainer_sequence import check_trainer

    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(parallelism_config=ParallelismConfig(sp_size=2)),
                                    compute_loss_func=None, args=types.SimpleNamespace(label_smoothing_factor=0.0))
    with pytest.raises(ValueError, match=r"ZeroPlugin\(sequence_parallel_size=2\)"):
        check_trainer(trainer, 2)


def test_the_trainer_evaluation_loop_gathers_through_the_accelerators_gather_for_metrics():
    """The Trainer sets gather_function to its accelerator's gather_for_metrics (HfZeroAccelerator's, which takes
    each sp replica once) and its evaluation loop gathers through that attribute: while both hold, the evaluation
    loss of the real runs above is the accelerator's."""
    import inspect

    from transformers import Trainer

    assert "self.gather_function = self.accelerator.gather_for_metrics" in inspect.getsource(
        Trainer.create_accelerator_and_postprocess)
    assert "self.gather_function(" in inspect.getsource(Trainer.evaluation_loop)


# ------------------------------------------------------------------------------------------ the padding (quick)
def _packed(collator):
    docs = [{"input_ids": [5, 6, 7, 8, 9], "seq_lengths": [2, 3]}, {"input_ids": [10, 11, 12, 13, 14, 15],
                                                                    "seq_lengths": [6]}]
    return collator(docs)


def test_the_padding_for_sp_leaves_plain_transformers_loss_unchanged():
    """TRL's padding-free collator as SFTTrainer builds it: the copy hf_zero makes pads the 11 packed tokens to 12
    (label -100, a position of its own), and Transformers' own model (no hf_zero) gives the same loss and gradient
    on both batches; the caller's collator is unchanged."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_zero.integrations.trainer_sequence import pad_to_multiple

    stock = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    padded = pad_to_multiple(stock, SP)
    assert padded is not stock and stock.pad_to_multiple_of is None and padded.pad_to_multiple_of == SP
    plain, cut = _packed(stock), _packed(padded)
    assert plain["input_ids"].shape == (1, 11) and cut["input_ids"].shape == (1, 12)
    assert cut["labels"][0, -1] == -100 and cut["position_ids"][0, -1] == 0
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=2, use_cache=False, attn_implementation="sdpa"))
    keys = ("input_ids", "labels", "position_ids")
    losses, grads = [], []
    for batch in (plain, cut):
        model.zero_grad()
        loss = model(**{k: batch[k] for k in keys}).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(losses[1], losses[0])
    torch.testing.assert_close(grads[1], grads[0])


def test_pad_to_multiple_keeps_a_multiple_and_leaves_other_collators_alone():
    from transformers import default_data_collator
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_zero.integrations.trainer_sequence import pad_to_multiple

    eight = DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=8)
    assert pad_to_multiple(eight, 2) is eight  # 8 is a multiple of 2 already
    three = pad_to_multiple(DataCollatorForLanguageModeling(pad_token_id=0, pad_to_multiple_of=3), 2)
    assert three.pad_to_multiple_of == 6
    assert pad_to_multiple(default_data_collator, 2) is default_data_collator  # a function: the forward says the fix
