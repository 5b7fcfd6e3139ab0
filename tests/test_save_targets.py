"""A save or an export replaces only what is its own (missing, empty, a previous checkpoint / export) and refuses a
regular file or a folder of the user's own files, touching nothing, unless asked to overwrite. One process, world
size 1 (where a save puts its files does not depend on the ranks)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import models
from hf_zero import ZeroConfig, shard_model
from hf_zero.checkpoint import CheckpointError, export_pretrained, load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def engine():
    model = models.make_model("gpt2")
    eng = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=2))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def ckpt(engine, tmp_path_factory):
    return save_checkpoint(engine, tmp_path_factory.mktemp("src") / "ckpt", step=3)


def _snapshot(folder: Path):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _user_folder(tmp_path: Path) -> Path:
    mine = tmp_path / "mine"
    (mine / "notes").mkdir(parents=True)
    (mine / "train.py").write_text("print('my script')\n")
    (mine / "notes" / "todo.txt").write_text("keep me\n")
    return mine


def test_save_refuses_a_regular_file(engine, tmp_path):
    target = tmp_path / "ckpt"
    target.write_bytes(b"my data\n")
    with pytest.raises(CheckpointError, match="is not a folder.*overwrite=True") as err:
        save_checkpoint(engine, target, step=1)
    assert str(target) in str(err.value)
    assert target.read_bytes() == b"my data\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "the refused save left folders behind"
    save_checkpoint(engine, target, step=1, overwrite=True)
    assert load_checkpoint(engine, target)["step"] == 1


def test_save_refuses_a_folder_of_other_files(engine, tmp_path):
    mine = _user_folder(tmp_path)
    before = _snapshot(mine)
    with pytest.raises(CheckpointError, match="holds files of its own.*overwrite=True") as err:
        save_checkpoint(engine, mine, step=1)
    assert str(mine) in str(err.value)
    assert _snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_save_replaces_an_empty_folder_and_a_previous_checkpoint(engine, tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    save_checkpoint(engine, target, step=1)
    save_checkpoint(engine, target, step=2)
    assert load_checkpoint(engine, target)["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _consolidate(*args):
    return subprocess.run([sys.executable, "-m", "hf_zero.cli", "consolidate", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_consolidate_refuses_a_file_and_a_foreign_folder(ckpt, tmp_path):
    target = tmp_path / "out"
    target.write_bytes(b"my data\n")
    res = _consolidate(ckpt, target)
    assert res.returncode == 1 and str(target) in res.stderr and "--overwrite" in res.stderr, res.stderr
    assert target.read_bytes() == b"my data\n"
    mine = _user_folder(tmp_path)
    before = _snapshot(mine)
    res = _consolidate(ckpt, mine)
    assert res.returncode == 1 and "holds files of its own" in res.stderr, res.stderr
    assert _snapshot(mine) == before
    res = _consolidate(ckpt, target, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert (target / "model.safetensors").is_file()


def test_export_replaces_an_earlier_export_but_not_a_checkpoint(engine, ckpt, tmp_path):
    out = tmp_path / "out"
    export_pretrained(ckpt, out, progress=False)
    (out / "README.md").write_text("my model card\n")
    export_pretrained(ckpt, out, progress=False)  # an earlier export: replaced, the README kept
    assert (out / "README.md").read_text() == "my model card\n"
    want = engine.full_state_dict()
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(got[k], want[k]) for k in got)
    with pytest.raises(CheckpointError, match="holds files of its own"):
        export_pretrained(ckpt, ckpt, progress=False)  # a checkpoint is not an export target
    assert load_checkpoint(engine, ckpt)["step"] == 3
    mine = _user_folder(tmp_path)
    before = _snapshot(mine)
    with pytest.raises(CheckpointError, match="holds files of its own"):
        export_pretrained(engine, mine, progress=False)  # online export too
    assert _snapshot(mine) == before
