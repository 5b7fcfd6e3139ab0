"""The contract between hf_zero and Accelerate's private names (hf_zero/integrations/_accelerate_private.py),
checked against the installed Accelerate: each name the adapter uses exists, is the kind of object it expects, and
does what it expects, as stock Accelerate's own `prepare`, `register_for_checkpointing`,
`register_load_state_pre_hook`, `save_state` and `load_accelerator_state` show it (in this process, with a stock
Accelerator on the CPU, no other process). A rename upstream fails here, naming the name, instead of somewhere in
a multi-process load_state test.

The same file keeps the rule that these names are used in the adapter only. It runs in the quick suite on the
installed versions, and under .ci/floors on the setup.cfg floors.
"""
from __future__ import annotations

import ast
import configparser
import inspect
import os
import random
import re
from pathlib import Path

import pytest
import torch
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_zero"
ADAPTER = PACKAGE / "integrations" / "_accelerate_private.py"


def setup_cfg_floor(name: str) -> Version:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    for line in cfg["options"]["install_requires"].splitlines():
        m = re.fullmatch(rf"\s*{re.escape(name)}\s*>=\s*([\w.]+)\s*", line)
        if m:
            return Version(m.group(1))
    raise AssertionError(f"setup.cfg declares no floor for {name}")


def test_the_installed_accelerate_is_one_setup_cfg_admits():
    import accelerate

    floor = setup_cfg_floor("accelerate")
    assert Version(accelerate.__version__) >= floor, f"accelerate {accelerate.__version__} < setup.cfg's {floor}"


class Counter:
    """A custom object for register_for_checkpointing."""

    def __init__(self, count: int) -> None:
        self.count = count

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state) -> None:
        self.count = state["count"]


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """A stock Accelerator with a model, an optimizer, two schedulers, a data loader, two custom objects and a
    load_state pre-hook, prepared and registered the public way, and the folder its save_state wrote."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.utils.data import DataLoader, TensorDataset

    AcceleratorState._reset_state(reset_partial_state=True)  # the state is a per-process singleton
    try:
        acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
                      torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)]
        loader = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2, shuffle=True)
        pmodel, poptimizer, s0, s1, ploader = acc.prepare(model, optimizer, *schedulers, loader)
        counters = [Counter(3), Counter(5)]
        acc.register_for_checkpointing(*counters)
        seen = []

        def hook(models, folder):
            seen.append((list(models), folder))

        acc.register_load_state_pre_hook(hook)
        for _ in range(2):  # a step, so the scheduler states differ from new ones
            poptimizer.step()
            s0.step()
            s1.step()
        rng = torch.get_rng_state(), random.getstate()  # what save_state records
        folder = acc.save_state(str(tmp_path_factory.mktemp("stock") / "state"))
        yield dict(rng=rng, acc=acc, model=pmodel, optimizer=poptimizer, schedulers=[s0, s1], loader=ploader,
                   raw_optimizer=optimizer, counters=counters, hook=hook, seen=seen, folder=str(folder))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# ------------------------------------------------------------------------------------ the registries
def test_every_registry_is_the_list_accelerate_fills(stock):
    from hf_zero.integrations._accelerate_private import LOAD_STATE_PRE_HOOKS, REGISTRIES, Registered

    acc = stock["acc"]
    for name, filled_by in REGISTRIES.items():
        assert isinstance(getattr(acc, name, None), list), f"Accelerator.{name} (filled by {filled_by}) is gone"
    hooks = getattr(acc, LOAD_STATE_PRE_HOOKS, None)
    assert hasattr(hooks, "values"), f"Accelerator.{LOAD_STATE_PRE_HOOKS} is no longer a dict of hooks"
    reg = Registered(acc)
    same = lambda got, want: len(got) == len(want) and all(a is b for a, b in zip(got, want))  # noqa: E731
    assert same(reg.models, [stock["model"]]), "prepare(model) no longer registers in Accelerator._models"
    assert same(reg.optimizers, [stock["optimizer"]]), "prepare(optimizer): not in Accelerator._optimizers"
    assert same(reg.schedulers, stock["schedulers"]), "prepare(scheduler): not in Accelerator._schedulers"
    assert same(reg.dataloaders, [stock["loader"]]), "prepare(data_loader): not in Accelerator._dataloaders"
    assert same(reg.custom_objects, stock["counters"]), "register_for_checkpointing: not in _custom_objects"
    assert same(reg.load_state_pre_hooks, [stock["hook"]]), "register_load_state_pre_hook: not in its dict"


def test_the_prepared_mark_is_on_what_prepare_returns_only(stock):
    from hf_zero.integrations._accelerate_private import is_prepared

    for what in ("model", "optimizer", "loader"):
        assert is_prepared(stock[what]), f"prepare no longer marks the {what} _is_accelerate_prepared"
    assert all(is_prepared(s) for s in stock["schedulers"])
    assert not is_prepared(stock["raw_optimizer"]) and not is_prepared(torch.nn.Linear(1, 1))


def test_hidden_registries_are_not_saved_and_come_back(stock, tmp_path):
    """What `Registered.hidden` hides, Accelerate's own save_state does not write; afterwards every registry is
    the same list object again."""
    from accelerate.utils import OPTIMIZER_NAME, SAFE_MODEL_NAME, SCHEDULER_NAME
    from hf_zero.integrations._accelerate_private import Registered, numbered

    acc, reg = stock["acc"], Registered(stock["acc"])
    before = (acc._models, acc._optimizers, acc._schedulers)
    with reg.hidden(models=True, optimizers=True, schedulers=True):
        assert reg.models == [] and reg.optimizers == [] and reg.schedulers == []
        acc.save_state(str(tmp_path / "hidden"))
    written = set(os.listdir(tmp_path / "hidden"))
    for name in (numbered(SAFE_MODEL_NAME, 0, ".safetensors"), numbered(OPTIMIZER_NAME, 0),
                 numbered(SCHEDULER_NAME, 0)):
        assert name not in written, f"{name} was saved while hidden"
    assert all(a is b for a, b in zip((acc._models, acc._optimizers, acc._schedulers), before))
    with reg.hidden(optimizers=True):  # only what is named
        assert len(reg.models) == 1 and reg.optimizers == [] and len(reg.schedulers) == 2


def test_add_model_registers_once(stock):
    from hf_zero.integrations._accelerate_private import Registered

    reg, extra = Registered(stock["acc"]), torch.nn.Linear(1, 1)
    try:
        reg.add_model(extra)
        reg.add_model(extra)
        assert [m is extra for m in reg.models] == [False, True]
    finally:
        stock["acc"]._models.remove(extra)


# ------------------------------------------------------------------------------------ the overridden methods
# Accelerator methods HfZeroAccelerator overrides, with stock's parameters (after self): a rename upstream would
# leave the override unused (the model unsharded, the state saved without its shards)
OVERRIDES = {
    "prepare": ("args", "device_placement"),
    "prepare_model": ("model", "device_placement", "evaluation_mode"),
    "prepare_optimizer": ("optimizer", "device_placement"),
    "prepare_data_loader": ("data_loader", "device_placement", "slice_fn_for_dispatch"),
    "gather_for_metrics": ("input_data", "use_gather_object"),
    "backward": ("loss", "kwargs"),
    "no_sync": ("model",),
    "clip_grad_norm_": ("parameters", "max_norm", "norm_type"),
    "clip_grad_value_": ("parameters", "clip_value"),
    "unscale_gradients": ("optimizer",),
    "get_state_dict": ("model", "unwrap"),
    "save_state": ("output_dir", "safe_serialization", "save_model_func_kwargs"),
    "load_state": ("input_dir", "load_kwargs", "load_model_func_kwargs"),
    "free_memory": ("objects",),
}


def test_every_accelerator_method_hf_zero_overrides_is_stocks():
    from accelerate import Accelerator
    from hf_zero.integrations.accelerate import HfZeroAccelerator

    P = inspect.Parameter
    overrides = {n for n, v in vars(HfZeroAccelerator).items() if not n.startswith("__") and hasattr(Accelerator, n)}
    assert overrides == set(OVERRIDES), (f"overridden now: {sorted(overrides)}; a name missing is one Accelerate no "
                                         f"longer has (hf_zero's method is never called), an extra one collides")
    for name, params in OVERRIDES.items():
        stock = inspect.signature(getattr(Accelerator, name))
        theirs = list(stock.parameters.values())[1:]
        assert tuple(p.name for p in theirs) == params, f"Accelerator.{name}{stock}"
        args = [object() for p in theirs if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        kwargs = {p.name: object() for p in theirs if p.kind is P.KEYWORD_ONLY}
        inspect.signature(vars(HfZeroAccelerator)[name]).bind(None, *args, **kwargs)  # stock's calls bind to ours


# ------------------------------------------------------------------------------------ the folder's files
def test_save_state_names_its_files_as_the_adapter_says(stock):
    from accelerate.utils import OPTIMIZER_NAME, SAFE_MODEL_NAME, SAMPLER_NAME, SCHEDULER_NAME
    from hf_zero.integrations._accelerate_private import (CUSTOM_STATE_FILE, custom_state_file, loader_state_file,
                                                          numbered, rng_state_file, saves_loader_state,
                                                          saves_sampler)

    written = set(os.listdir(stock["folder"]))
    expected = {numbered(SAFE_MODEL_NAME, 0, ".safetensors"), numbered(OPTIMIZER_NAME, 0),
                numbered(SCHEDULER_NAME, 0), numbered(SCHEDULER_NAME, 1), custom_state_file(0), custom_state_file(1),
                rng_state_file(0)}
    assert written == expected, f"stock save_state wrote {sorted(written)}; the adapter names {sorted(expected)}"
    assert sorted(f for f in written if CUSTOM_STATE_FILE.search(f)) == [custom_state_file(0), custom_state_file(1)]
    loader = stock["loader"]  # a map-style loader: no sampler file, no loader state; the predicates agree
    assert saves_sampler(loader) == (numbered(SAMPLER_NAME, 0) in written) and not saves_sampler(object())
    assert saves_loader_state(loader) == (loader_state_file(0) in written)


def test_load_accelerator_state_takes_the_adapters_arguments(stock):
    """The adapter passes Accelerate's loader its arguments by position: their names and order are pinned, and a
    real call with them restores the schedulers, the RNG state and the step as save_state wrote them."""
    from accelerate.checkpointing import load_accelerator_state as upstream
    from hf_zero.integrations._accelerate_private import LOAD_ACCELERATOR_STATE_PARAMETERS, load_accelerator_state

    params = list(inspect.signature(upstream).parameters.values())
    names = tuple(p.name for p in params[:len(LOAD_ACCELERATOR_STATE_PARAMETERS)])
    assert names == LOAD_ACCELERATOR_STATE_PARAMETERS, f"load_accelerator_state{inspect.signature(upstream)}"
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD

    schedulers = stock["schedulers"]
    saved = [s.state_dict() for s in schedulers]
    for s in schedulers:
        s.step()
    here = torch.get_rng_state(), random.getstate()
    try:
        torch.rand(3), random.random()  # the stream moves on from where save_state recorded it
        out = load_accelerator_state(stock["folder"], [], [], list(schedulers), [], 0, None, "cpu",
                                     {"weights_only": True})
        loaded_rng = torch.get_rng_state(), random.getstate()
    finally:  # later tests in this process get the stream they had
        torch.set_rng_state(here[0])
        random.setstate(here[1])
    assert [s.state_dict() for s in schedulers] == saved
    assert torch.equal(loaded_rng[0], stock["rng"][0]) and loaded_rng[1] == stock["rng"][1]
    assert out.get("step") == stock["acc"].step


# ------------------------------------------------------------------------------------ the house rule
def _private_uses(path: Path, names: set) -> list:
    """(line, what) for every attribute, string or import of `names` in the file, and every import from
    accelerate.checkpointing."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in names:
            out.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            out.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accelerate.checkpointing"):
            out.append((node.lineno, f"from {node.module} import ..."))
    return out


def test_accelerates_private_names_are_used_in_the_adapter_only():
    from hf_zero.integrations import _accelerate_private as adapter

    names = set(adapter.REGISTRIES) | {adapter.LOAD_STATE_PRE_HOOKS, adapter.PREPARED_MARK}
    assert _private_uses(ADAPTER, names), "the rule would never fire: the adapter itself must show them"
    found = [f"{path.relative_to(ROOT)}:{line} uses {what}" for path in sorted(PACKAGE.rglob("*.py"))
             if path != ADAPTER for line, what in _private_uses(path, names)]
    assert not found, "Accelerate's private names belong in integrations/_accelerate_private.py:\n" + "\n".join(found)
