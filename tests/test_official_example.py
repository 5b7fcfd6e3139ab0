"""Issue #45 item 1: a script shaped like Transformers' run_clm_no_trainer.py (tests/scripts/official_clm.py), changed
only by hf_zero's import line, at ZeRO stage 3 on 2 gloo ranks through the real `accelerate launch`, against the same
script under stock Accelerate (DDP):

- its last line, `unwrap_model(model).save_pretrained(output_dir, is_main_process=..., save_function=accelerator.save)`
  on every rank, writes the files stock writes (model.safetensors, config.json, generation_config.json), with the
  same tensors, and `from_pretrained` loads them (before: hf_zero's "parameters are partitioned" error, and a folder
  holding only the configs);
- the per-micro-batch losses, Transformers' `get_scheduler` learning rates, the eval perplexity through
  `gather_for_metrics` (8 eval rows over 2 ranks in batches of 3: the last batch is uneven) and the custom tracker's
  log (`init_trackers` / `log`) equal stock's;
- `--checkpointing_steps` writes `step_N` folders with `accelerator.save_state`, and a run resumed from one with
  `--resume_from_checkpoint` ends where stock's uninterrupted run ends.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from test_accelerate import accelerate_launch

pytestmark = pytest.mark.slow

SCRIPT = "official_clm.py"
RTOL = 1e-5


def _run(tmp_path, name, backend, model, *extra):
    out = tmp_path / name
    zero_yaml = None
    if backend == "zero":
        zero_yaml = tmp_path / "zero.yaml"
        zero_yaml.write_text("zero:\n  stage: 3\n")
    accelerate_launch(SCRIPT, 2, "--backend", backend, "--model", model, "--output_dir", str(out), *extra,
                      zero_yaml=zero_yaml)
    return out


def _results(folder):
    return json.load(open(folder / "all_results.json"))


def _tracker(folder):
    return [json.loads(line) for line in open(folder / "tracker.jsonl")]


def _close(a, b, what):
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               rtol=RTOL, atol=1e-7, msg=what)


def _same_weights(ours, ref):
    a, b = load_file(ours / "model.safetensors"), load_file(ref / "model.safetensors")
    assert set(a) == set(b), set(a) ^ set(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=1e-6, msg=k)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def runs(request, tmp_path_factory):
    """Stock and hf_zero stage 3, each with tracking and a save_state every 2 optimizer steps."""
    tmp = tmp_path_factory.mktemp(f"official_{request.param}")
    extra = ("--with_tracking", "--checkpointing_steps", "2")
    return request.param, tmp, _run(tmp, "stock", "ddp", request.param, *extra), _run(tmp, "zero", "zero",
                                                                                      request.param, *extra)


def test_save_pretrained_on_every_rank_writes_what_stock_writes(runs):
    from transformers import AutoModelForCausalLM

    model, _, ref, ours = runs
    files = lambda d: sorted(f for f in os.listdir(d) if not f.startswith("step_") and f != "tracker.jsonl")
    assert files(ours) == files(ref), (files(ours), files(ref))
    _same_weights(ours, ref)
    assert json.load(open(ours / "config.json")) == json.load(open(ref / "config.json"))
    loaded = AutoModelForCausalLM.from_pretrained(ours)
    stock = AutoModelForCausalLM.from_pretrained(ref)
    for (n, p), (m, q) in zip(loaded.state_dict().items(), stock.state_dict().items()):
        assert n == m
        torch.testing.assert_close(p, q, rtol=RTOL, atol=1e-6, msg=n)
    if model == "gpt2":  # tied: written once, tied again on load
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


def test_training_eval_and_tracking_equal_stock(runs):
    _, _, ref, ours = runs
    a, b = _results(ours), _results(ref)
    assert len(a["train_losses"]) == len(b["train_losses"]) == 20  # 2 epochs of 10 micro-batches (40 rows, 2 ranks, batch 2)
    for key in ("train_losses", "lr", "eval_loss", "perplexity"):
        _close(a[key], b[key], key)
    assert a["eval_rows"] == b["eval_rows"] == 8  # gather_for_metrics dropped the padding of the uneven batch
    ta, tb = _tracker(ours), _tracker(ref)
    assert [sorted(x) for x in ta] == [sorted(x) for x in tb] and ta[0] == tb[0]  # config first, then the logs
    for x, y in zip(ta[1:], tb[1:]):
        assert x["step"] == y["step"]
        _close([x["perplexity"], x["eval_loss"]], [y["perplexity"], y["eval_loss"]], "tracker")


def test_resume_from_a_step_folder_ends_where_stock_ends(runs):
    model, tmp, ref, ours = runs
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(ours) if d.startswith("step_"))
    assert steps == [2, 4, 6, 8, 10]  # 10 optimizer steps, a save_state every 2
    resumed = _run(tmp, "resumed", "zero", model, "--resume_from_checkpoint", str(ours / "step_4"))
    a, b = _results(resumed), _results(ref)
    _close(a["lr"], b["lr"][4:], "lr after resuming")  # the scheduler resumed at step 4
    _close(a["train_losses"], b["train_losses"][8:], "losses after resuming")  # 8 micro-batches were skipped
    _close(a["perplexity"], b["perplexity"], "perplexity")
    _same_weights(resumed, ref)
