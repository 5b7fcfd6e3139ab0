"""The Trainer's in-loop evaluation at stage 3 with gradient checkpointing on (issue #20, "Keep").

tests/scripts/trainer_eval_train.py under the real `accelerate launch` on 2 gloo ranks: ZeroTrainer at stage 3 against
the stock Trainer under Accelerate's DDP, same seed and data; a tiny Llama, gradient accumulation 2, clipping,
fp32, evaluation before the first step and every 2 steps (eval_strategy="steps", eval_on_start) on an eval set that
Accelerate pads to equal batches per rank. The eval losses at each eval step, the training losses and grad norms,
and the weights save_model writes at the end agree within the tolerance of the other Trainer tests (1e-5 relative).
"""
import json

import pytest

from test_accelerate import accelerate_launch, assert_close_runs, assert_same_weights

pytestmark = pytest.mark.slow

WORLD = 2


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_eval") / "ddp"
    accelerate_launch("trainer_eval_train.py", WORLD, "--backend", "ddp", "--out", str(out))
    return out


def test_stage3_in_loop_eval_with_gradient_checkpointing_matches_stock_trainer(tmp_path, stock):
    out = tmp_path / "zero3"
    accelerate_launch("trainer_eval_train.py", WORLD, "--backend", "zero", "--stage", "3", "--out", str(out))
    ours, ref = json.load(open(out / "log.json")), json.load(open(stock / "log.json"))
    assert ours["world"] == ref["world"] == WORLD
    # evaluated before step 1 and after steps 2 and 4, on both
    assert ours["eval_steps"] == ref["eval_steps"] == [0, 2, 4], (ours["eval_steps"], ref["eval_steps"])
    # checkpointing really ran (2 layers x 2 micro-batches x 4 steps), in training only, on both
    assert ours["checkpoint_calls"] == ref["checkpoint_calls"] == {"train": 16, "eval": 0}, (
        ours["checkpoint_calls"], ref["checkpoint_calls"])
    assert len(ours["eval_losses"]) == len(ref["eval_losses"]) == 3
    assert ours["eval_losses"] == pytest.approx(ref["eval_losses"], rel=1e-5, abs=1e-6), (
        ours["eval_losses"], ref["eval_losses"])
    assert_close_runs(out, stock)  # training losses and grad norms, step by step
    assert_same_weights(out / "final" / "model.safetensors", stock / "final" / "model.safetensors")
