"""The contract between hf_zero and Transformers' private names (hf_zero/integrations/_transformers_private.py),
checked against the installed Transformers in this process (no other process, no training):

- every Trainer method ZeroTrainerMixin overrides or calls on super() exists with the parameters the adapter
  records, and the override accepts them (a rename upstream would leave hf_zero's override silently unused);
- where ZeroTrainer runs a Trainer method with one of its module-level names meaning hf_zero's object, that
  method does look the name up there, and runs hf_zero's object: the Trainer builds its accelerator with the
  factory given for `Accelerator`, its readers read through the `torch` given (a planted file is refused naming the
  file and the opt-in, which stock Transformers would not say), and `_save_checkpoint` hands its rotation of older
  checkpoints to the deferral (or, on a Transformers that rotates otherwise, the adapter says it cannot defer);
- a Transformers layer calls the function the engine installs as its `_gradient_checkpointing_func`;
- none of it leaks: bytecode, a function's globals and transformers.trainer appear in the adapter only.

It runs in the quick suite on the installed versions, and under .ci/floors on the setup.cfg floors.
"""
from __future__ import annotations

import ast
import fractions
import inspect
import os
import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from packaging.version import Version

from test_private_api_accelerate import setup_cfg_floor

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_zero"
ADAPTER = PACKAGE / "integrations" / "_transformers_private.py"
OPT_IN = "OPT-IN"


def test_the_installed_transformers_is_one_setup_cfg_admits():
    import transformers

    floor = setup_cfg_floor("transformers")
    assert Version(transformers.__version__) >= floor, f"transformers {transformers.__version__} < {floor}"


# ------------------------------------------------------------------------------------ the methods
def test_every_trainer_method_zero_trainer_overrides_is_pinned():
    from hf_zero.integrations._transformers_private import TRAINER_METHODS, rotation_deferrable
    from hf_zero.integrations.trainer import ZeroTrainerMixin
    from transformers import Trainer

    overrides = {n for n, v in vars(ZeroTrainerMixin).items()
                 if not n.startswith("__") and callable(v) and hasattr(Trainer, n)}
    assert overrides <= set(TRAINER_METHODS), f"pin in TRAINER_METHODS: {overrides - set(TRAINER_METHODS)}"
    for name, params in TRAINER_METHODS.items():
        theirs = getattr(Trainer, name, None)
        if theirs is None and name == "_finalize_training":  # Transformers 5.1: the rotation is not deferred there
            assert not rotation_deferrable(), "ZeroTrainer defers the rotation to a _finalize_training never called"
            continue
        assert theirs is not None, f"transformers.Trainer.{name} is gone: ZeroTrainer's override is never called"
        got = tuple(inspect.signature(theirs).parameters)[1:]
        if params is not None:
            assert got == params, f"Trainer.{name}{inspect.signature(theirs)}; the adapter records {params}"
        ours = vars(ZeroTrainerMixin).get(name)
        if ours is not None:  # a call the Trainer's own signature admits binds to the override
            P = inspect.Parameter
            theirs_params = list(inspect.signature(theirs).parameters.values())[1:]
            args = [object() for p in theirs_params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
            kwargs = {p.name: object() for p in theirs_params if p.kind is P.KEYWORD_ONLY}
            inspect.signature(ours).bind(None, *args, **kwargs)


@pytest.fixture
def bare_trainer(tmp_path):
    """A Trainer object with real TrainingArguments and nothing else set up (its methods are called one by one);
    Accelerate's per-process state that TrainingArguments makes is reset afterwards."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        trainer = Trainer.__new__(Trainer)
        trainer.args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[])
        trainer.model = torch.nn.Linear(2, 2)
        trainer.is_fsdp_enabled = trainer.is_deepspeed_enabled = False
        yield trainer
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# ------------------------------------------------------------------------------------ the module-level names
def test_the_trainer_builds_its_accelerator_by_the_module_name(bare_trainer):
    import accelerate
    import transformers.trainer as hf_trainer
    from hf_zero.integrations._transformers_private import create_accelerator
    from transformers import Trainer

    assert vars(hf_trainer).get("Accelerator") is accelerate.Accelerator
    assert "Accelerator" in inspect.getclosurevars(Trainer.create_accelerator_and_postprocess).globals

    class Built(Exception):
        pass

    def factory(**kwargs):
        raise Built(kwargs)

    with pytest.raises(Built) as built:
        create_accelerator(bare_trainer.create_accelerator_and_postprocess, factory)
    assert "dataloader_config" in built.value.args[0]  # the Trainer's own arguments for its Accelerator
    assert vars(hf_trainer)["Accelerator"] is accelerate.Accelerator and not hasattr(bare_trainer, "accelerator")


def _planted(path: Path, state: dict) -> None:
    """A file torch.load(weights_only=True) refuses: `state` plus a Fraction."""
    torch.save({**state, "note": fractions.Fraction(1, 3)}, path)


def test_the_trainers_readers_read_through_the_modules_torch(bare_trainer, tmp_path):
    import transformers.trainer as hf_trainer
    from hf_zero.checkpoint.pickles import UntrustedPickleError
    from hf_zero.integrations._transformers_private import READERS, reading_without_code
    from transformers import Trainer

    assert vars(hf_trainer).get("torch") is torch
    for name in READERS:
        assert "torch" in inspect.getclosurevars(getattr(Trainer, name)).globals, f"Trainer.{name} reads otherwise"
    original_load = torch.load
    bare_trainer.accelerator = types.SimpleNamespace(scaler=torch.amp.GradScaler("cpu"))
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    cases = {"_load_rng_state": ("rng_state.pth", rng), "_load_scaler": ("scaler.pt", {}),
             "_load_from_checkpoint": ("pytorch_model.bin", bare_trainer.model.state_dict())}
    assert set(cases) == set(READERS)
    for name, (file, state) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        _planted(folder / file, state)
        with pytest.raises(UntrustedPickleError) as refused:
            reading_without_code(getattr(bare_trainer, name), OPT_IN, False)(str(folder))
        assert file in str(refused.value) and OPT_IN in str(refused.value), str(refused.value)
    # trusted, the same reader unpickles the file in full and applies it (the RNG state it was saved with)
    torch.rand(2), random.random()
    reading_without_code(bare_trainer._load_rng_state, OPT_IN, True)(str(tmp_path / "_load_rng_state"))
    assert torch.equal(torch.get_rng_state(), rng["cpu"]) and random.getstate() == rng["python"]
    assert torch.load is original_load and vars(hf_trainer)["torch"] is torch


def test_the_rotation_is_handed_to_the_deferral(bare_trainer, tmp_path):
    """The Trainer's own `_save_checkpoint` (save_total_limit=1, an older checkpoint on disk) rotates nothing
    while it runs; the deferred call deletes the older checkpoint and keeps the new one. A subclass's own
    `_save_checkpoint` is not run at all (the caller saves and waits instead)."""
    import transformers.trainer as hf_trainer
    from hf_zero.integrations._transformers_private import rotation_deferrable, save_checkpoint_deferring_rotation
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

    class OwnSave(Trainer):
        def _save_checkpoint(self, model, trial):
            raise AssertionError("a subclass's own _save_checkpoint must not be run by the deferral")

    own = OwnSave.__new__(OwnSave)
    assert save_checkpoint_deferring_rotation(own._save_checkpoint, None, None, lambda rotate: None) is False
    if not rotation_deferrable():  # e.g. Transformers 5.1: the Trainer calls its _rotate_checkpoints method
        assert "rotate_checkpoints" not in vars(hf_trainer) or not hasattr(Trainer, "_finalize_training")
        assert save_checkpoint_deferring_rotation(bare_trainer._save_checkpoint, None, None, print) is False
        return
    assert "rotate_checkpoints" in inspect.getclosurevars(Trainer._save_checkpoint).globals

    class Saving(Trainer):  # the Trainer's own _save_checkpoint; only what it calls around the rotation is stubbed
        def save_model(self, output_dir=None, _internal_call=False):
            os.makedirs(output_dir, exist_ok=True)

        def store_flos(self):
            pass

    out = tmp_path / "run"
    trainer = Saving.__new__(Saving)
    trainer.args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], save_total_limit=1,
                                     save_only_model=True)
    trainer.control = TrainerControl()
    trainer.state = TrainerState(global_step=3, stateful_callbacks=[trainer.control])
    trainer.callback_handler = types.SimpleNamespace(callbacks=[])
    trainer.hp_search_backend = None
    (out / "checkpoint-1").mkdir(parents=True)
    deferred = []
    assert save_checkpoint_deferring_rotation(trainer._save_checkpoint, None, None, deferred.append) is True
    assert sorted(os.listdir(out)) == ["checkpoint-1", "checkpoint-3"] and len(deferred) == 1
    deferred[0]()
    assert os.listdir(out) == ["checkpoint-3"]


def test_a_transformers_layer_calls_the_installed_checkpoint_function():
    """engine/activations.py installs its checkpoint function as each layer's `_gradient_checkpointing_func`
    (duck typed: the engine imports no Transformers): a Transformers decoder layer in training calls it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=32)
    model = LlamaForCausalLM(config)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    calls = []

    def fn(forward, *args, **kwargs):
        calls.append(forward)
        return forward(*args, **kwargs)

    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)
              and hasattr(m, "_gradient_checkpointing_func")]
    assert layers, "no Transformers module carries gradient_checkpointing and _gradient_checkpointing_func"
    for layer in layers:
        layer._gradient_checkpointing_func = fn
    model.train()
    model(torch.randint(0, 32, (1, 5))).logits.sum().backward()
    assert len(calls) == config.num_hidden_layers


# ------------------------------------------------------------------------------------ the house rule
def test_the_trainers_internals_are_used_in_the_adapter_only():
    def uses(path: Path) -> list:
        out = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr in ("__globals__", "co_names", "__code__",
                                                                 "FunctionType"):
                out.append((node.lineno, node.attr))
            elif isinstance(node, ast.Import) and any(a.name == "transformers.trainer" for a in node.names):
                out.append((node.lineno, "import transformers.trainer"))
            elif isinstance(node, ast.ImportFrom) and node.module == "transformers.trainer":
                out.append((node.lineno, "from transformers.trainer import"))
        return out

    assert uses(ADAPTER), "the rule would never fire: the adapter itself must show them"
    found = [f"{p.relative_to(ROOT)}:{line} uses {what}" for p in sorted(PACKAGE.rglob("*.py")) if p != ADAPTER
             for line, what in uses(p)]
    assert not found, "the Trainer's internals belong in integrations/_transformers_private.py:\n" + "\n".join(found)
