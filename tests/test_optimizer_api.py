"""The engine's optimizer is a real `torch.optim.Optimizer` (issue 20, item 2): every API a training loop, an LR
scheduler, Accelerate or the Trainer calls on an optimizer behaves as on stock AdamW.

Each check runs the same calls on hf_zero's optimizer and on a stock AdamW over an identical model and compares.
World size 1 in this process where ranks do not matter; hooks firing once per step on every rank and the training
equal to stock AdamW at world sizes 2 and 3 through tests/_dist.py; `optimizer.optimizer` of a real
`HfZeroAccelerator.prepare` in a subprocess. Issue 34, item 4 and issue 45, item 4: it is the user's optimizer
itself (an instance of its class and of ZeroOptimizer) and writes none of torch's private attributes; LR schedulers (torch's and Transformers'), zero_grad, add_param_group and
load_state_dict against stock AdamW in plain single-process training.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch

import models
from _dist import run_scenarios

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 4


def _pair(stage: int):
    """(engine, its optimizer, stock model, stock AdamW) over identical tiny GPT-2s with the same param groups."""
    from hf_zero import ZeroConfig, shard_model

    stock_model = models.make_model("gpt2")
    stock_opt = models.make_optimizer(stock_model)
    model = models.make_model("gpt2")
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=stage))
    return engine, engine.optimizer, stock_model, stock_opt


def _train_step(model, opt, batch, backward=None):
    loss = model(input_ids=batch, labels=batch).loss
    (backward or (lambda l: l.backward()))(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _both_train(stage: int, setup, steps: int = STEPS):
    """Run `setup(opt)` on both optimizers, train `steps` steps, return (zero's, stock's) setup results + losses."""
    engine, opt, stock_model, stock_opt = _pair(stage)
    ours, ref = setup(opt), setup(stock_opt)
    batches = models.make_batches(steps, 1)
    for step in range(steps):
        ours.setdefault("losses", []).append(_train_step(engine.model, opt, batches[step][0], engine.backward))
        ref.setdefault("losses", []).append(_train_step(stock_model, stock_opt, batches[step][0]))
    return engine, ours, ref


@pytest.mark.parametrize("stage", [1, 3])
def test_is_a_torch_optimizer_with_torch_attributes(stage):
    engine, opt, _, stock = _pair(stage)
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, torch.optim.AdamW)  # the user's class
    assert opt.defaults == stock.defaults
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in stock.param_groups]
    # state in torch's shape: keyed by the segment tensors the user reads
    _train_step(engine.model, opt, models.make_batches(1, 1)[0][0], engine.backward)
    segs = [s.tensor for s in opt.segments]
    assert len(opt.state) == len(segs) and all(any(k is s for s in segs) for k in opt.state)
    for s in segs:
        assert opt.state[s]["exp_avg"].shape == s.shape
    assert set(opt.__getstate__()) == set(stock.__getstate__()) == {"defaults", "state", "param_groups"}
    assert "ZeroOptimizer" in repr(opt) and "Parameter Group 1" in repr(opt)
    for set_to_none in (True, False):
        opt.zero_grad(set_to_none=set_to_none)
        stock.zero_grad(set_to_none=set_to_none)
    with pytest.raises(NotImplementedError, match="before"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)]})


def _step_hooks(opt):
    calls = {"pre": [], "post": [], "removed": 0}
    seen = []

    def pre(o, args, kwargs):
        seen.append(o is opt)
        calls["pre"].append(round(o.param_groups[0]["lr"], 12))

    def post(o, args, kwargs):
        seen.append(o is opt)
        calls["post"].append(len(calls["pre"]))

    def removed(o, args, kwargs):
        calls["removed"] += 1

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    opt.register_step_post_hook(removed).remove()
    calls["seen"] = seen
    return calls


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_step_pre_and_post_hooks_fire_like_stock(stage):
    engine, ours, ref = _both_train(stage, _step_hooks)
    assert ours["pre"] == ref["pre"] and ours["post"] == ref["post"] == list(range(1, STEPS + 1))
    assert ours["removed"] == ref["removed"] == 0
    assert all(ours["seen"]) and all(ref["seen"]) and len(ours["seen"]) == 2 * STEPS
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)


def test_global_step_hooks_see_the_engine_optimizer():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    engine, opt, stock_model, stock_opt = _pair(2)
    seen = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: seen.append(("pre", o))),
               register_optimizer_step_post_hook(lambda o, a, k: seen.append(("post", o)))]
    try:
        batch = models.make_batches(1, 1)[0][0]
        _train_step(engine.model, opt, batch, engine.backward)
        _train_step(stock_model, stock_opt, batch)
    finally:
        for h in handles:
            h.remove()
    # stock: pre then post, once each per step; ZeRO's step is one optimizer step (the user's class's update
    # inside it runs without torch's hook wrapper)
    ours = [(k, o is opt) for k, o in seen if o is not stock_opt]
    assert ours == [("pre", True), ("post", True)], ours
    assert [(k, o is stock_opt) for k, o in seen if o is stock_opt] == [("pre", True), ("post", True)]


def test_hooks_registered_on_the_users_optimizer_before_sharding_fire():
    """Under stock Accelerate the optimizer the user built is the one stepped: its hooks fire. Same here."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("gpt2")
    user_opt = models.make_optimizer(model)
    fired = []
    user_opt.register_step_post_hook(lambda o, a, k: fired.append(o))
    engine = shard_model(model, user_opt, ZeroConfig(stage=2))
    assert engine.optimizer is user_opt  # one object: the user's optimizer, sharded in place
    _train_step(engine.model, engine.optimizer, models.make_batches(1, 1)[0][0], engine.backward)
    assert fired == [engine.optimizer]


def _state_dict_hooks(opt):
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o is opt)))

    def post(o, sd):
        calls.append(("sd_post", o is opt, sorted(sd)))
        sd["extra"] = 1
        return sd

    opt.register_state_dict_post_hook(post)
    opt.register_state_dict_pre_hook(lambda o: calls.append(("sd_first", o is opt)), prepend=True)

    def load_pre(o, sd):
        calls.append(("load_pre", o is opt, sd.get("extra")))
        sd = dict(sd)
        sd.pop("extra")
        return sd

    opt.register_load_state_dict_pre_hook(load_pre)
    opt.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o is opt)))
    return {"calls": calls, "opt": opt}


@pytest.mark.parametrize("stage", [2, 3])
def test_state_dict_hooks_like_stock(stage):
    engine, ours, ref = _both_train(stage, _state_dict_hooks, steps=1)
    opt = engine.optimizer
    exp = [opt.state[s.tensor]["exp_avg"].clone() for s in opt.segments]
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)
    for s, e in zip(opt.segments, exp):
        torch.testing.assert_close(opt.state[s.tensor]["exp_avg"], e, rtol=0, atol=0)
    stock = ref.pop("opt")
    stock.load_state_dict(stock.state_dict())
    assert ours["calls"] == ref["calls"] and len(ref["calls"]) == 5, (ours["calls"], ref["calls"])


def _schedulers(kind):
    def setup(opt):
        if kind == "lambda":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        elif kind == "cosine":
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3, eta_min=1e-4)
        else:  # a scheduler built before a step hook: the hooks still see its steps
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.05], total_steps=STEPS + 1)
        lrs = []
        opt.register_step_post_hook(lambda o, a, k: (sched.step(), lrs.append([g["lr"] for g in o.param_groups])))
        return {"lrs": lrs, "sched": sched}
    return setup


@pytest.mark.parametrize("kind", ["lambda", "cosine", "onecycle"])
def test_lr_schedulers_match_stock(kind):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        engine, ours, ref = _both_train(3, _schedulers(kind))
    assert ours["lrs"] == ref["lrs"] and len(ours["lrs"]) == STEPS
    assert ours["sched"].get_last_lr() == ref["sched"].get_last_lr()
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)


def test_pickles_like_stock():
    engine, opt, _, stock = _pair(1)
    state = pickle.loads(pickle.dumps(opt.__getstate__()))
    assert [len(g["params"]) for g in state["param_groups"]] == [len(g["params"]) for g in opt.param_groups]
    assert set(state) == set(stock.__getstate__())
    # a copy would be an optimizer over no engine: refused with the way to save it (stock copies)
    with pytest.raises(TypeError, match="save_checkpoint"):
        pickle.loads(pickle.dumps(opt))


# ------------------------------------------------------------------------------------ several ranks (gloo)
def hooked_training(rank, world_size, stage):
    """Every rank: step pre/post hooks and a LambdaLR on the engine optimizer; the training itself."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("gpt2")
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=stage))
    opt = engine.optimizer
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    events = []
    opt.register_step_pre_hook(lambda o, a, k: events.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, a, k: events.append(("post", o is opt, o.param_groups[0]["lr"])))
    losses = []
    for step, (mb,) in enumerate(models.make_batches(STEPS, 1)):
        x = models.rank_slice(mb, rank, world_size)
        loss = engine.model(input_ids=x, labels=x).loss
        engine.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    sd = engine.full_state_dict()
    return {"events": events, "losses": losses, "state": {k: v.clone() for k, v in sd.items()} if rank == 0 else None}


def stock_hooked_training():
    model = models.make_model("gpt2")
    opt = models.make_optimizer(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    events = []
    opt.register_step_pre_hook(lambda o, a, k: events.append(("pre", o is opt)))
    opt.register_step_post_hook(lambda o, a, k: events.append(("post", o is opt, o.param_groups[0]["lr"])))
    for (mb,) in models.make_batches(STEPS, 1):
        model(input_ids=mb, labels=mb).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {"events": events, "state": model.state_dict()}


@pytest.mark.parametrize("world_size", [2, 3])
def test_hooks_fire_once_per_step_on_every_rank_and_training_equals_stock(world_size):
    results = run_scenarios(world_size, [(f"stage{s}", hooked_training, {"stage": s}) for s in (2, 3)])
    ref = stock_hooked_training()
    for name, per_rank in results.items():
        if isinstance(per_rank, Exception):
            raise per_rank
        for r in per_rank:
            assert r["events"] == ref["events"], (name, r["events"])
        state = per_rank[0]["state"]
        for k, v in ref["state"].items():
            if k in state:
                torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=f"{name} {k}")


# ------------------------------------------------------------------------------------ Accelerate, one process
ACCEL_SCRIPT = r'''
import json, sys, warnings
warnings.simplefilter("error", UserWarning)  # "lr_scheduler.step() before optimizer.step()" fails the run
backend, out = sys.argv[1], sys.argv[2]
if backend == "zero":
    from hf_zero import HfZeroAccelerator as Accelerator
else:
    from accelerate import Accelerator
import torch
sys.path.insert(0, sys.argv[3])
import models
acc = Accelerator()
model = models.make_model("gpt2")
optimizer = models.make_optimizer(model)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
events = []
inner = optimizer.optimizer
inner.register_step_pre_hook(lambda o, a, k: events.append(["pre", o is inner]))
inner.register_step_post_hook(lambda o, a, k: events.append(["post", o is inner, o.param_groups[0]["lr"]]))
losses = []
for (mb,) in models.make_batches(4, 1):
    loss = model(input_ids=mb, labels=mb).loss
    acc.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    losses.append(loss.item())
json.dump({"events": events, "losses": losses, "lr": scheduler.get_last_lr()}, open(out, "w"))
'''


def test_accelerate_prepared_optimizer_hooks_match_stock(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "HF_ZERO_"))}
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    script = tmp_path / "accel.py"
    script.write_text(ACCEL_SCRIPT)
    logs = {}
    for backend in ("zero", "stock"):
        out = tmp_path / f"{backend}.json"
        res = subprocess.run([sys.executable, str(script), backend, str(out), HERE], env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, f"{backend}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        logs[backend] = json.loads(out.read_text())
    assert logs["zero"]["events"] == logs["stock"]["events"]
    assert len(logs["zero"]["events"]) == 8
    assert logs["zero"]["lr"] == logs["stock"]["lr"]
    torch.testing.assert_close(torch.tensor(logs["zero"]["losses"]), torch.tensor(logs["stock"]["losses"]),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------ the Trainer, one process
TRAINER_SCRIPT = r'''
import json, sys
backend, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, sys.argv[3])
if backend == "zero":
    import hf_zero
    from hf_zero import ZeroPlugin, ZeroTrainer
import torch
import models
from datasets import Dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

rows = [mb[0] for (mb,) in models.make_batches(8, 1)]
ds = Dataset.from_dict({"input_ids": [r.tolist() for r in rows], "labels": [r.tolist() for r in rows]})
events = []


class Hooks(TrainerCallback):
    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        inner = optimizer.optimizer  # what AcceleratedOptimizer wraps
        inner.register_step_pre_hook(lambda o, a, k: events.append(["pre", o is inner]))
        inner.register_step_post_hook(lambda o, a, k: events.append(["post", o is inner, o.param_groups[0]["lr"]]))

    def on_optimizer_step(self, args, state, control, **kwargs):
        events.append(["on_optimizer_step", state.global_step])


args = TrainingArguments(output_dir=out + ".run", max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2,
                         lr_scheduler_type="cosine", warmup_steps=1, report_to=[], seed=0, use_cpu=True,
                         disable_tqdm=True, save_strategy="no", logging_steps=1)
model = models.make_model("gpt2")
kw = {"zero_plugin": ZeroPlugin(stage=3)} if backend == "zero" else {}
trainer = (ZeroTrainer if backend == "zero" else Trainer)(model=model, args=args, train_dataset=ds,
                                                          callbacks=[Hooks()], **kw)
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
json.dump({"events": events, "losses": losses}, open(out, "w"))
'''


def test_trainer_optimizer_hooks_and_callbacks_match_stock(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "HF_ZERO_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TOKENIZERS_PARALLELISM="false")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_SCRIPT)
    logs = {}
    for backend in ("zero", "stock"):
        out = tmp_path / f"{backend}.json"
        res = subprocess.run([sys.executable, str(script), backend, str(out), HERE], env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, f"{backend}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        logs[backend] = json.loads(out.read_text())
    assert logs["zero"]["events"] == logs["stock"]["events"]
    assert [e[0] for e in logs["zero"]["events"]].count("post") == 4
    assert len(logs["zero"]["losses"]) == 4
    torch.testing.assert_close(torch.tensor(logs["zero"]["losses"]), torch.tensor(logs["stock"]["losses"]),
                               rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------ torch's own code (issue 34, 4)
# ZeroOptimizer is the user's optimizer, sharded in place: hooks, LR schedulers, zero_grad and the state dicts are
# torch's code. Each check runs the same calls on a stock AdamW trained in plain PyTorch.

def _private(obj):
    return {k for k in vars(obj) if k.startswith("_")}


def _params_equal(engine, stock_model):
    ours = engine.full_state_dict()
    for k, v in stock_model.state_dict().items():
        if k in ours:
            torch.testing.assert_close(ours[k], v, rtol=1e-4, atol=1e-5, msg=k)


def test_sets_no_private_attribute_torch_does_not():
    """After the same calls (sharding, an LR scheduler, a step, zero_grad, state_dict / load_state_dict) the
    instance holds exactly the private attributes a stock AdamW holds, and its class's step exactly what torch's
    wrapper puts on AdamW's: hf_zero writes none of torch's private names. Its own names are public."""
    from hf_zero import ZeroOptimizer

    engine, opt, stock_model, stock = _pair(2)
    assert _private(opt) == _private(stock), _private(opt) ^ _private(stock)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, stock)]
    batch = models.make_batches(1, 1)[0][0]
    _train_step(engine.model, opt, batch, engine.backward)
    _train_step(stock_model, stock, batch)
    for s in scheds:
        s.step()
    for o in (opt, stock):
        o.zero_grad(set_to_none=False)
        o.load_state_dict(o.state_dict())
    assert _private(opt) == _private(stock), _private(opt) ^ _private(stock)
    assert "_opt_called" in _private(opt)  # written by torch's scheduler wrapper, as on stock
    assert set(vars(opt)) - set(vars(stock)) == {
        "groups", "reducer", "comm", "config", "device", "world", "scaler", "grads_prepared", "grads_finite",
        "user_optimizer_class", "segments", "kernel", "param_group_of", "has_grad"}
    assert set(vars(ZeroOptimizer.step)) == set(vars(type(stock).step)) == {"__wrapped__", "hooked"}
    assert not [k for k in vars(ZeroOptimizer) if k.startswith("_") and not k.startswith("__")
                and not callable(vars(ZeroOptimizer)[k])]  # no class-level private data either


def test_step_hooks_get_torch_arguments_and_may_replace_them():
    """A pre-hook sees (optimizer, (optimizer,), {}) and may return new (args, kwargs): here a closure, whose
    value step() returns; the post-hook sees the replaced arguments. Once per step, as on stock AdamW."""
    def setup(opt):
        calls = []

        def pre(o, args, kwargs):
            calls.append(("pre", o is opt, len(args), args[0] is o, sorted(kwargs)))
            return (o,), {"closure": lambda: 7.0}

        def post(o, args, kwargs):
            calls.append(("post", o is opt, len(args), args[0] is o, sorted(kwargs)))

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
        return {"calls": calls}

    engine, opt, stock_model, stock = _pair(3)
    ours, ref = setup(opt), setup(stock)
    returned = {"ours": [], "ref": []}
    for (mb,) in models.make_batches(STEPS, 1):
        engine.backward(engine.model(input_ids=mb, labels=mb).loss)
        returned["ours"].append(opt.step())
        stock_model(input_ids=mb, labels=mb).loss.backward()
        returned["ref"].append(stock.step())
        opt.zero_grad()
        stock.zero_grad()
    assert returned["ours"] == returned["ref"] == [7.0] * STEPS
    assert ours["calls"] == ref["calls"] == [("pre", True, 1, True, []), ("post", True, 1, True, ["closure"])] * STEPS
    _params_equal(engine, stock_model)


def _hf_linear(opt):
    from transformers import get_linear_schedule_with_warmup
    return get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS + 1)


def _hf_cosine(opt):
    from transformers import get_cosine_schedule_with_warmup
    return get_cosine_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=STEPS)


def _torch_sequential(opt):
    lr_sched = torch.optim.lr_scheduler
    return lr_sched.SequentialLR(opt, [lr_sched.LinearLR(opt, start_factor=0.25, total_iters=2),
                                       lr_sched.ExponentialLR(opt, gamma=0.5)], milestones=[2])


def _scheduled_training(engine, opt, model, make_sched, sched=None):
    """torch's documented loop: optimizer.step() then scheduler.step(); every group's lr before each step."""
    sched = sched or make_sched(opt)
    lrs = []
    for (mb,) in models.make_batches(STEPS, 1):
        loss = model(input_ids=mb, labels=mb).loss
        engine.backward(loss) if engine is not None else loss.backward()
        lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
        opt.zero_grad()
    return lrs, sched.get_last_lr()


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("make_sched", [_hf_linear, _hf_cosine, _torch_sequential])
def test_lr_schedule_and_parameters_equal_stock(stage, make_sched):
    """Transformers' and torch's schedulers on the engine optimizer: the same per-group lr sequence and the same
    parameters after the steps as on stock AdamW, and no warning (e.g. "lr_scheduler.step() before
    optimizer.step()", or one saying optimizer.step was replaced after the scheduler was built)."""
    engine, opt, stock_model, stock = _pair(stage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = _scheduled_training(engine, opt, engine.model, make_sched)
        ref = _scheduled_training(None, stock, stock_model, make_sched)
    assert ours == ref and len({lr[0] for lr in ours[0]}) > 1 and ours[0][-1][0] != ours[0][-1][1]
    _params_equal(engine, stock_model)


def test_scheduler_built_on_the_users_optimizer_then_pointed_here():
    """What HfZeroAccelerator.prepare does with a scheduler built before sharding (`scheduler.optimizer = the
    engine's`): torch's step tracking is there (no warning, the same lrs and parameters as stock)..."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("gpt2")
    user_opt = models.make_optimizer(model)
    sched = _hf_linear(user_opt)
    engine = shard_model(model, user_opt, ZeroConfig(stage=2))
    sched.optimizer = engine.optimizer
    stock_model = models.make_model("gpt2")
    stock = models.make_optimizer(stock_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = _scheduled_training(engine, engine.optimizer, engine.model, None, sched)
        ref = _scheduled_training(None, stock, stock_model, _hf_linear)
    assert ours == ref
    _params_equal(engine, stock_model)


def test_scheduler_stepped_first_warns_as_on_stock():
    """... and it is torch's real tracking, not a silenced check: stepping the scheduler before the optimizer warns
    on the engine optimizer (a scheduler built on it, or one pointed at it) as it does on stock AdamW."""
    from hf_zero import ZeroConfig, shard_model

    engine, opt, _, stock = _pair(2)
    model = models.make_model("gpt2")
    user_opt = models.make_optimizer(model)
    pointed = _hf_linear(user_opt)
    pointed.optimizer = shard_model(model, user_opt, ZeroConfig(stage=2)).optimizer
    for sched in (_hf_linear(opt), pointed, _hf_linear(stock)):
        with pytest.warns(UserWarning, match=r"lr_scheduler.step\(\)` before `optimizer.step\(\)"):
            sched.step()  # the first step after the constructor's is the one torch checks


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_resets_the_engine_gradients(stage, set_to_none):
    """zero_grad between two backwards drops the first one's gradient, as on stock AdamW; torch's zero_grad runs
    over the segments (whose .grad is None outside step) and the engine's accumulators hold zeros."""
    engine, opt, stock_model, stock = _pair(stage)
    first, second = models.make_batches(2, 1)
    for model, o, backward in ((engine.model, opt, engine.backward), (stock_model, stock, lambda l: l.backward())):
        backward(model(input_ids=first[0], labels=first[0]).loss)
        o.zero_grad(set_to_none=set_to_none)
        if o is opt:
            trainable = [g for g in engine.groups if g.plan.trainable]
            assert trainable and all(not g.grad_shard.any() for g in trainable)
            assert all(s.tensor.grad is None for s in opt.segments)
        else:
            assert all((p.grad is None) == set_to_none for p in stock_model.parameters())
        backward(model(input_ids=second[0], labels=second[0]).loss)
        o.step()
    _params_equal(engine, stock_model)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_step_without_backward_after_zero_grad_is_stocks(set_to_none):
    """After zero_grad(set_to_none=True) a step with no backward changes nothing, as stock AdamW's (every .grad is
    None); after zero_grad(set_to_none=False) it is stock AdamW's step over zero gradients (issue #45 item 2)."""
    engine, opt, stock_model, stock = _pair(2)
    batch = models.make_batches(1, 1)[0][0]
    engine.backward(engine.model(input_ids=batch, labels=batch).loss)
    stock_model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    stock.step()
    opt.zero_grad(set_to_none=set_to_none)
    stock.zero_grad(set_to_none=set_to_none)
    for p in stock_model.parameters():
        assert p.grad is None if set_to_none else (p.grad is not None and not p.grad.any())
    before = {n: p.detach().clone() for n, p in stock_model.named_parameters()}
    opt.step()
    stock.step()
    moved = any(not torch.equal(p, before[n]) for n, p in stock_model.named_parameters())
    assert moved != set_to_none  # the reference tells the two cases apart
    _params_equal(engine, stock_model)


def test_add_param_group_raises_and_changes_nothing():
    engine, opt, _, _ = _pair(2)
    groups = [dict(g) for g in opt.param_groups]
    extra = torch.zeros(3, requires_grad=True)
    for group in ({"params": [extra]}, {"params": [extra], "lr": 0.0}, opt.param_groups[0]):
        with pytest.raises(NotImplementedError, match=r"cannot be added afterwards.*Put every group"):
            opt.add_param_group(group)
    assert [dict(g) for g in opt.param_groups] == groups


def test_load_state_dict_is_torchs_and_the_step_uses_what_it_loaded():
    """torch's load_state_dict replaces the groups and state: the next step runs over the loaded ones (here a
    changed lr and Adam's float `step` of an older state dict, made a tensor by AdamW's __setstate__), equal to
    stock AdamW loading the same change."""
    engine, opt, stock_model, stock = _pair(2)
    batches = models.make_batches(2, 1)
    _train_step(engine.model, opt, batches[0][0], engine.backward)
    _train_step(stock_model, stock, batches[0][0])
    for o in (opt, stock):
        sd = o.state_dict()
        sd["param_groups"][1]["lr"] = 0.07
        for s in sd["state"].values():
            s["step"] = float(s["step"])
        o.load_state_dict(sd)
    assert opt.param_groups[1]["lr"] == stock.param_groups[1]["lr"] == 0.07
    assert all(torch.is_tensor(s["step"]) for s in opt.state.values())
    assert [type(s["step"]) for s in opt.state.values()][:1] == [type(s["step"]) for s in stock.state.values()][:1]
    _train_step(engine.model, opt, batches[1][0], engine.backward)
    _train_step(stock_model, stock, batches[1][0])
    _params_equal(engine, stock_model)
