"""Issue #11, "ZeRO that survives real training code": the patterns real training scripts use, each against an
independent reference (plain single-process PyTorch on the concatenated global batch, each rank getting its slice).

Items (one or more tests each, world sizes 2 and 3 on gloo):
 1. stage 3: reading a partitioned parameter's values outside forward raises a Python error that names the
    parameter and points to `engine.gathered_parameters()`; shape/numel/dtype/device stay the unsharded ones.
 2. stage 3, LoRA-style (mostly frozen) model: two forwards of the same units before one backward.
 3. rank-dependent unused parameters (a branch that runs on even ranks only), stages 0-3.
 4. stages 1/2: frozen parameters are never communicated (ledger: only the trainable Ψ_t is moved).
 5. stage 3 with user-level `torch.utils.checkpoint.checkpoint(block, h, use_reentrant=...)`: gathered memory
    stays a few units, all-gathers stay the paper's 2Ψ (forward + backward).
 6. `engine.save_checkpoint()` in the middle of gradient accumulation does not change the step.
 7. short scripts (build, 1 step, full_state_dict, destroy_process_group, exit) exit 0 every time.

Only hf_zero's public top-level names are used (`ZeroConfig`, `shard_model` and the engine's methods).  Scenario
functions run inside the workers of tests/_dist.py; a rank killed by a signal is reported there as
"no result; process exit code -N".
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import models
from _dist import DistResults
from _recipe import reference_train, state_mismatches

WORLD_SIZES = (2, 3)
RTOL, ATOL = 1e-5, 1e-6
STEPS = 2
ACCUM = 2
HANG_TIMEOUT_S = 30  # item 3 runs the engine on its own gloo group with this timeout: a hang fails in 30 s, not 120


# ------------------------------------------------------------------------------------------ a plain stack of blocks
# Sizes (d=11, hidden=14, vocab=41): a block has 355 parameters (487 with the extra branch), the root (embedding,
# final norm, head) 965; none divides by 2 or 3, so every flat group is padded at both world sizes.
VOCAB, D, HIDDEN, ROWS, SEQ = 41, 11, 14, 12, 8


class RealCodeBlock(nn.Module):
    """Pre-norm residual MLP block; `extra` (optional) is a branch the caller may or may not use."""

    def __init__(self, with_extra: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D)
        self.extra = nn.Linear(D, D) if with_extra else None

    def forward(self, x, use_extra: bool = False):
        y = x + self.fc2(torch.tanh(self.fc1(self.norm(x))))
        if use_extra and self.extra is not None:
            y = y + torch.tanh(self.extra(y))
        return y


class RealCodeBranch(nn.Module):
    """Item 3: a module outside the blocks that only some ranks run (its own unit, hence its own flat group)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class RealCodeStack(nn.Module):
    """Embedding -> n blocks [-> branch] -> norm -> head -> cross-entropy.  `ckpt`: None (plain calls), "reentrant"
    or "non_reentrant": every block call goes through torch.utils.checkpoint.checkpoint(block, h, ...).
    `use_extra` (forward) switches on the blocks' `extra` sub-modules and the `branch`, where the model has them."""

    def __init__(self, n_blocks: int = 2, with_extra: bool = False, ckpt: str = None, with_branch: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(RealCodeBlock(with_extra) for _ in range(n_blocks))
        self.branch = RealCodeBranch() if with_branch else None
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)
        self.ckpt = ckpt

    def forward(self, x, targets, use_extra: bool = False):
        h = self.emb(x)
        for block in self.blocks:
            if self.ckpt is None:
                h = block(h, use_extra)
            else:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        if use_extra and self.branch is not None:
            h = self.branch(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_stack(n_blocks: int = 2, with_extra: bool = False, ckpt: str = None, with_branch: bool = False,
               seed: int = 0) -> RealCodeStack:
    torch.manual_seed(seed)
    model = RealCodeStack(n_blocks, with_extra, ckpt, with_branch)
    with torch.no_grad():  # larger weights: gradients big enough that clip_grad_norm_(1.0) is active
        for p in model.parameters():
            p.mul_(3.0)
    return model


def stack_optimizer(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(models.param_groups(model), betas=(0.9, 0.95), eps=1e-3)


def stack_batches(steps: int, seed: int = 4321):
    """batches[step] = (tokens, targets), ROWS x SEQ each (ROWS divides by 2 and 3)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen), torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen))
            for _ in range(steps)]


def uses_extra(rank: int) -> bool:
    """Item 3: the branch runs on even ranks only."""
    return rank % 2 == 0


def _detach(sd):
    return {k: v.detach().clone() for k, v in sd.items()}


def _padded(n: int, world_size: int) -> int:
    return -(-n // world_size) * world_size


# ---------------------------------------------------------------------------------------------- references (local)
def ref_stack(steps: int, world_size: int, ckpt_blocks: int = None, with_extra: bool = False,
              with_branch: bool = False) -> Dict[str, Any]:
    """Single process.  The loss is the mean over ranks of each rank's loss on its slice (rank r runs the extra
    sub-modules / branch iff uses_extra(r)), i.e. exactly the gradient DDP averages; clip 1.0; AdamW."""
    model = make_stack(ckpt_blocks or 2, with_extra, with_branch=with_branch)

    def loss_of(batch):
        x, t = batch
        return sum(model(models.rank_slice(x, r, world_size), models.rank_slice(t, r, world_size),
                         use_extra=uses_extra(r)) for r in range(world_size)) / world_size

    return _train_reference(model, stack_optimizer(model), stack_batches(steps), loss_of)


def _train_reference(model, opt, batches, loss_of) -> Dict[str, Any]:
    """Plain PyTorch: for each batch, loss_of(batch).backward(), clip 1.0, step."""
    init = _detach(model.state_dict())
    params = [p for p in model.parameters() if p.requires_grad]
    losses, norms = [], []
    for batch in batches:
        loss = loss_of(batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1.0)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": _detach(model.state_dict()), "init": init}


def ref_two_forward(steps: int = STEPS, variant: str = "lora") -> Dict[str, Any]:
    """Single process, Llama (LoRA variant): loss = model(a).loss + model(b).loss on the full global batches."""
    torch.set_num_threads(1)
    model = models.make_model("llama", variant)
    return _train_reference(model, models.make_optimizer(model), models.make_batches(steps, 2),
                            lambda ab: model(input_ids=ab[0], labels=ab[0]).loss + model(input_ids=ab[1],
                                                                                          labels=ab[1]).loss)


# ------------------------------------------------------------------------------------------ scenarios (in workers)
def _record_step(out, loss_value, norm):
    out["losses"].append(loss_value)
    out["norms"].append(float(norm))


def _final_state(out, engine, rank):
    """Collective: the full state on rank 0 (and how many entries the other ranks got: want 0)."""
    sd = engine.full_state_dict()
    if rank == 0:
        out["state"] = _detach(sd)
    else:
        out["state_len"] = len(sd)
    return out


def sc_read_outside(rank: int, world_size: int, reads: bool = True) -> Dict[str, Any]:
    """Item 1: stage 3 Llama, one step, then metadata, gathered values, full_state_dict, and (`reads`) the reads
    outside forward."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("llama")
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    meta_before = {n: (tuple(p.shape), p.numel(), p.dtype, p.device) for n, p in model.named_parameters()}
    total_before = sum(p.numel() for p in model.parameters())
    opt = models.make_optimizer(model)
    engine = shard_model(model, opt, ZeroConfig(stage=3))
    (mb,) = models.make_batches(1, 1)[0]
    x = models.rank_slice(mb, rank, world_size)
    engine.backward(model(input_ids=x, labels=x).loss)
    engine.clip_grad_norm_(1.0)
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    out: Dict[str, Any] = {
        "meta_before": meta_before, "total_before": total_before,
        "meta_after": {n: (tuple(p.shape), p.numel(), p.dtype, p.device) for n, p in model.named_parameters()},
        "total_after": sum(p.numel() for p in model.parameters()),
    }
    with engine.gathered_parameters():
        out["gathered"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    sd = engine.full_state_dict()
    if rank == 0:
        out["state"] = _detach(sd)
    # the reads that must raise (not crash): each recorded as (exception type or None, message or value)
    lm_head = model.lm_head.weight
    up = model.model.layers[1].mlp.up_proj.weight
    out["names"] = {"lm_head": names[id(lm_head)], "up_proj": names[id(up)]}
    attempts = {}
    out["attempts"] = attempts
    if not reads:
        return out

    def attempt(label, fn):
        try:
            attempts[label] = (None, repr(fn()))
        except Exception as exc:  # what the issue asks for: a Python exception, not a signal
            attempts[label] = (type(exc).__name__, str(exc))

    attempt("lm_head.norm()", lambda: float(lm_head.norm()))
    attempt("print(lm_head)", lambda: print(lm_head, file=io.StringIO()))
    attempt("up_proj.sum()", lambda: float(up.sum()))
    attempt("model.cpu(); lm_head.abs().max()", lambda: (model.cpu(), float(model.lm_head.weight.abs().max()))[1])
    return out


def sc_two_forward(rank: int, world_size: int, steps: int = STEPS, variant: str = "lora") -> Dict[str, Any]:
    """Item 2: stage 3, Llama LoRA variant, loss = model(a).loss + model(b).loss, one backward, clip, step."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("llama", variant)
    opt = models.make_optimizer(model)
    engine = shard_model(model, opt, ZeroConfig(stage=3))
    out: Dict[str, Any] = {"losses": [], "norms": []}
    for a, b in models.make_batches(steps, 2):
        xa, xb = models.rank_slice(a, rank, world_size), models.rank_slice(b, rank, world_size)
        loss = model(input_ids=xa, labels=xa).loss + model(input_ids=xb, labels=xb).loss
        engine.backward(loss)
        norm = engine.clip_grad_norm_(1.0)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        _record_step(out, loss.item(), norm)
    return _final_state(out, engine, rank)


def sc_unused_branch(rank: int, world_size: int, stage: int, where: str, steps: int = STEPS) -> Dict[str, Any]:
    """Item 3.  where="block": every block (a unit every rank runs) has an `extra` sub-module that only even ranks
    use; where="unit": a separate `branch` module (its own unit) that only even ranks run.  The engine runs on its
    own gloo group with a short timeout, so a hang becomes an error within HANG_TIMEOUT_S rather than 120 s."""
    import torch.distributed as dist
    from hf_zero import ZeroConfig, shard_model

    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=HANG_TIMEOUT_S))
    model = make_stack(2, with_extra=where == "block", with_branch=where == "unit")
    opt = stack_optimizer(model)
    engine = shard_model(model, opt, ZeroConfig(stage=stage, units=["RealCodeBlock", "RealCodeBranch"]),
                         process_group=group)
    out: Dict[str, Any] = {"losses": [], "norms": []}
    for x, t in stack_batches(steps):
        loss = model(models.rank_slice(x, rank, world_size), models.rank_slice(t, rank, world_size),
                     use_extra=uses_extra(rank))
        engine.backward(loss)
        norm = engine.clip_grad_norm_(1.0)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        _record_step(out, loss.item(), norm)
    _final_state(out, engine, rank)
    engine.close()
    return out


def sc_frozen_comm(rank: int, world_size: int, stage: int) -> Dict[str, Any]:
    """Item 4: the recipe of _recipe.engine_train on the Llama LoRA variant (per-step comm_stats included)."""
    from _recipe import engine_train

    return engine_train(rank, world_size, "llama", "lora", stage=stage, steps=STEPS, accum=ACCUM)


def sc_user_checkpoint(rank: int, world_size: int, ckpt: str, n_blocks: int, steps: int = STEPS) -> Dict[str, Any]:
    """Item 5: stage 3, every block call wrapped in torch.utils.checkpoint.checkpoint by the model itself."""
    from hf_zero import ZeroConfig, shard_model

    model = make_stack(n_blocks, ckpt=ckpt)
    opt = stack_optimizer(model)
    engine = shard_model(model, opt, ZeroConfig(stage=3, units=["RealCodeBlock"], prefetch=1))
    out: Dict[str, Any] = {"losses": [], "norms": [], "comm": []}
    for x, t in stack_batches(steps):
        engine.reset_comm_stats()
        loss = model(models.rank_slice(x, rank, world_size), models.rank_slice(t, rank, world_size))
        engine.backward(loss)
        norm = engine.clip_grad_norm_(1.0)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        out["comm"].append(copy.deepcopy(engine.comm_stats()))
        _record_step(out, loss.item(), norm)
    out["gathered_params_peak"] = engine.memory_stats()["gathered_params_peak"]
    return _final_state(out, engine, rank)


def sc_save_mid_accum(rank: int, world_size: int, stage: int, no_sync: bool = True, steps: int = STEPS,
                      accum: int = ACCUM):
    """Item 6: the _recipe recipe (GPT-2) with engine.save_checkpoint(dir) after every step's first micro-batch
    backward (inside no_sync, or with `no_sync=False` a synchronising backward), then the rest of the accumulation,
    clip and step."""
    import torch.distributed as dist
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import save_checkpoint

    where = [tempfile.mkdtemp(prefix="hfz_midsave_") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    ckpt_dir = os.path.join(where[0], "ckpt")
    model = models.make_model("gpt2")
    opt = models.make_optimizer(model)
    engine = shard_model(model, opt, ZeroConfig(stage=stage))
    out: Dict[str, Any] = {"losses": [], "norms": [], "saved": []}
    try:
        for step, micro in enumerate(models.make_batches(steps, accum)):
            total = 0.0
            for j, mb in enumerate(micro):
                x = models.rank_slice(mb, rank, world_size)
                ctx = engine.no_sync() if no_sync and j < accum - 1 else contextlib.nullcontext()
                with ctx:
                    loss = model(input_ids=x, labels=x).loss
                    engine.backward(loss / accum)
                total += loss.item()
                if j == 0:
                    save_checkpoint(engine, ckpt_dir)
                    out["saved"].append(os.path.isdir(ckpt_dir))
            norm = engine.clip_grad_norm_(1.0)
            engine.optimizer.step()
            engine.optimizer.zero_grad()
            _record_step(out, total / accum, norm)
        _final_state(out, engine, rank)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(where[0], ignore_errors=True)
    return out


def sc_skipped_unit_debug(rank: int, world_size: int) -> Dict[str, Any]:
    """Item 3, stage 3: a whole unit (the branch) that odd ranks skip, with debug_collectives: the mismatch must
    be a CollectiveMismatchError naming that unit, not a hang or a crash."""
    from hf_zero import ZeroConfig, shard_model

    model = make_stack(2, with_branch=True)
    engine = shard_model(model, stack_optimizer(model),
                         ZeroConfig(stage=3, units=["RealCodeBlock", "RealCodeBranch"], debug_collectives=True))
    x, t = stack_batches(1)[0]
    try:
        loss = model(models.rank_slice(x, rank, world_size), models.rank_slice(t, rank, world_size),
                     use_extra=uses_extra(rank))
        engine.backward(loss)
    except Exception as exc:  # noqa: BLE001 - the test reads which error it was
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "message": ""}


def sc_memory_split(rank: int, world_size: int, stage: int) -> Dict[str, Any]:
    """Item 4: memory_stats() counts trainable and frozen parameter bytes apart (Llama LoRA variant)."""
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("llama", "lora")
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    tensors = {"trainable": sum(1 for p in model.parameters() if p.requires_grad),
               "frozen": sum(1 for p in model.parameters() if not p.requires_grad)}
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=stage))
    stats = engine.memory_stats()
    engine.close()
    return {"stats": {k: stats[k] for k in ("params", "params_trainable", "params_frozen")},
            "trainable": trainable, "frozen": frozen, "tensors": tensors}


UNUSED_CASES = [("block", 0), ("block", 1), ("block", 2), ("block", 3), ("unit", 0), ("unit", 1), ("unit", 2)]
SAVE_CASES = [(1, "no_sync"), (2, "no_sync"), (3, "no_sync"), (1, "sync")]
CKPT_BLOCKS = 8  # item 5: enough blocks that "the whole model gathered" is far above the bound


def scenarios_for(world_size: int):
    sc = [("read-outside-s3", sc_read_outside, {}),
          ("two-forward-lora-s3", sc_two_forward, {})]
    sc += [(f"unused-{w}-s{s}", sc_unused_branch, dict(stage=s, where=w)) for w, s in UNUSED_CASES]
    sc += [(f"frozen-comm-s{s}", sc_frozen_comm, dict(stage=s)) for s in (1, 2)]
    sc += [(f"user-ckpt-{c}", sc_user_checkpoint, dict(ckpt=c, n_blocks=CKPT_BLOCKS))
           for c in ("reentrant", "non_reentrant")]
    sc += [(f"save-mid-accum-s{s}-{mode}", sc_save_mid_accum, dict(stage=s, no_sync=mode == "no_sync"))
           for s, mode in SAVE_CASES]
    sc += [(f"memory-split-s{s}", sc_memory_split, dict(stage=s)) for s in (0, 1, 2, 3)]
    sc += [("skipped-unit-debug-s3", sc_skipped_unit_debug, {})]  # last: its engine is left mid-forward
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


# ---------------------------------------------------------------------------------------------------- comparisons
def run_problems(ranks: List[Dict[str, Any]], ref: Dict[str, Any], world_size: int) -> List[str]:
    """Differences from the reference: per-step losses (mean of the ranks' local losses), the global norm on every
    rank, the final full state on rank 0 ({} elsewhere)."""
    problems = []
    assert len(ranks) == world_size
    want_loss = torch.tensor(ref["losses"], dtype=torch.float64)
    losses = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64).mean(0)
    if not torch.allclose(losses, want_loss, rtol=RTOL, atol=ATOL):
        problems.append(f"per-step losses {losses.tolist()} != reference {want_loss.tolist()}")
    want_norm = torch.tensor(ref["norms"], dtype=torch.float64)
    for r, res in enumerate(ranks):
        norms = torch.tensor(res["norms"], dtype=torch.float64)
        if not torch.allclose(norms, want_norm, rtol=RTOL, atol=ATOL):
            problems.append(f"rank {r}: global grad norms {norms.tolist()} != reference {want_norm.tolist()}")
    for r, res in enumerate(ranks[1:], start=1):
        if res["state_len"] != 0:
            problems.append(f"rank {r}: full_state_dict() returned {res['state_len']} entries, want {{}}")
    bad = state_mismatches(ranks[0]["state"], ref["state"], RTOL, ATOL)
    if bad:
        problems.append("final state differs from the reference:\n  " + "\n  ".join(bad))
    return problems


def check_run(ranks: List[Dict[str, Any]], ref: Dict[str, Any], world_size: int) -> None:
    problems = run_problems(ranks, ref, world_size)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------------- item 1
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage3_param_read_outside_forward_raises(dist_results, world_size):
    """Issue #11 item 1: at stage 3, after a step, reading a partitioned parameter outside forward
    (`w.norm()`, `print(w)`, a unit's weight, `model.cpu()` then a read) raises an Exception naming the parameter
    and `gathered_parameters` (today: SIGSEGV); shape/numel/dtype/device and the total numel stay the unsharded
    ones; inside gathered_parameters() the values equal full_state_dict() and the single-process reference."""
    ranks = dist_results(world_size, "read-outside-s3")
    ref = reference_train("llama", "full", 1, 1)
    problems = []
    for r, res in enumerate(ranks):
        if res["meta_after"] != res["meta_before"]:
            changed = sorted(n for n in res["meta_before"] if res["meta_after"].get(n) != res["meta_before"][n])
            problems.append(f"rank {r}: shape/numel/dtype/device changed for {changed}")
        if not res["total_after"] == res["total_before"] == sum(v.numel() for v in ref["init"].values()):
            problems.append(f"rank {r}: sum(p.numel()) is {res['total_after']}, want the unsharded "
                            f"{res['total_before']}")
        missing = sorted(set(res["gathered"]) - set(ref["state"]))
        if missing:
            problems.append(f"rank {r}: parameters {missing} are not in the state dict")
        want = {k: v for k, v in ref["state"].items() if k in res["gathered"]}
        bad = state_mismatches(res["gathered"], want, RTOL, ATOL)
        if bad:
            problems.append(f"rank {r}: inside gathered_parameters() values differ from the reference: {bad}")
        bad = state_mismatches(res["gathered"], {k: ranks[0]["state"][k] for k in res["gathered"]}, 0, 0)
        if bad:
            problems.append(f"rank {r}: inside gathered_parameters() values differ from full_state_dict(): {bad}")
        for label, (exc_type, text) in res["attempts"].items():
            wanted = res["names"]["up_proj" if "up_proj" in label else "lm_head"]
            if exc_type is None:
                problems.append(f"rank {r}: {label} did not raise (returned {text})")
            elif not any(n in text for n in wanted) or "gathered_parameters" not in text:
                problems.append(f"rank {r}: {label} raised {exc_type} whose message does not name {wanted} and "
                                f"mention gathered_parameters: {text!r}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------------- item 2
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage3_lora_two_forwards_one_backward(dist_results, world_size):
    """Issue #11 item 2: stage 3, Llama LoRA variant (only the LoRA matrices and the final norm train),
    loss = model(a).loss + model(b).loss then one backward, clip, step, for 2 steps == single-process reference
    doing the same two-forward loss on the full batches (today: SIGSEGV)."""
    ranks = dist_results(world_size, "two-forward-lora-s3")
    check_run(ranks, ref_two_forward(), world_size)


# ------------------------------------------------------------------------------------------------------- item 3
@pytest.mark.parametrize("where,stage", UNUSED_CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_rank_dependent_unused_parameters(dist_results, world_size, where, stage):
    """Issue #11 item 3: parameters that get a gradient on even ranks and none on odd ranks.  where="block": each
    block (a unit every rank runs, so stage 3 applies) has an `extra` sub-module used on even ranks only;
    where="unit": a separate `branch` module (its own unit, so its own flat group) that only even ranks run
    (stages 0-2: at stage 3 every rank must run the same units).  Training must equal the single-process reference
    whose loss is the mean of the ranks' losses (DDP with find_unused_parameters=True computes the same average,
    with zeros from the ranks that skipped the branch)."""
    ref = ref_stack(STEPS, world_size, with_extra=where == "block", with_branch=where == "unit")
    moved = [k for k in ref["state"] if ("extra" in k or "branch" in k)
             and not torch.equal(ref["state"][k], ref["init"][k])]
    assert len(moved) == (4 if where == "block" else 2), "the reference must train the branch"
    ranks = dist_results(world_size, f"unused-{where}-s{stage}")
    check_run(ranks, ref, world_size)


# ------------------------------------------------------------------------------------------------------- item 4
@pytest.mark.parametrize("stage", (1, 2))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_frozen_parameters_are_not_communicated(dist_results, world_size, stage):
    """Issue #11 item 4: Llama LoRA variant (2% of the parameters train), accumulation 2 with no_sync.  Per step,
    the ledger moves only the trainable Ψ_t: all-gather Ψ_t (params after the step) and reduce-scatter Ψ_t
    (stage 1: once, at the synchronising backward) or m·Ψ_t (stage 2: every micro-batch), each up to padding:
    every flat group is padded by < world_size elements and holds at least one trainable tensor, so the padding
    of the trainable groups is at most (world_size - 1) * (number of trainable tensors).  No all-reduce of data.
    Training equals the single-process reference."""
    model = models.make_model("llama", "lora")
    psi_t = models.trainable_numel(model)
    n_trainable = sum(1 for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > 10 * psi_t
    pad = (world_size - 1) * n_trainable
    ranks = dist_results(world_size, f"frozen-comm-s{stage}")
    rs_per_step = 1 if stage == 1 else ACCUM
    problems = []
    for r, res in enumerate(ranks):
        for step, comm in enumerate(res["comm"]):
            ag = comm.get("all_gather", {}).get("elements", 0)
            rs = comm.get("reduce_scatter", {}).get("elements", 0)
            where = f"rank {r} step {step} (Ψ_t={psi_t}, frozen={frozen}, padding <= {pad})"
            if not psi_t <= ag <= psi_t + pad:
                problems.append(f"{where}: all-gather moved {ag} elements, want Ψ_t up to padding")
            if not rs_per_step * psi_t <= rs <= rs_per_step * (psi_t + pad):
                problems.append(f"{where}: reduce-scatter moved {rs} elements, want {rs_per_step}·Ψ_t up to padding")
            if comm.get("all_reduce", {}).get("elements", 0) != 0:
                problems.append(f"{where}: data all-reduce at stage {stage}: {comm['all_reduce']}")
            if comm["total"]["elements"] != ag + rs:
                problems.append(f"{where}: data traffic other than all-gather and reduce-scatter: {comm}")
    problems += run_problems(ranks, reference_train("llama", "lora", STEPS, ACCUM), world_size)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------------- item 5
@pytest.mark.parametrize("ckpt", ("reentrant", "non_reentrant"))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage3_user_checkpoint_keeps_gathers_bounded(dist_results, world_size, ckpt):
    """Issue #11 item 5: stage 3, prefetch 1, a stack of 8 blocks (each a unit) whose forward calls
    torch.utils.checkpoint.checkpoint(block, h, use_reentrant=...).  Asserted, with unit sizes computed here from
    numel padded up to a multiple of the world size (fp32, 4 bytes):
    - memory_stats()["gathered_params_peak"] <= root + (prefetch + 2) blocks: the root unit (embedding, final
      norm, head) stays gathered through the backward by design, plus the block in use, the prefetched one and
      one being released (the last block, which by default (reshard_after_forward="auto", as torchtitan does)
      also stays gathered from its forward into its backward, is the block in use when the backward starts; the
      whole model would be root + 8 blocks);
    - per step, all-gather <= root + 2 x blocks and >= the unpadded Ψ: each unit once in the forward, each block
      once more for its recomputation + backward (the paper's 2Ψ of all-gathers; recomputing must not cost a
      third gather); non-reentrant: <= root + (2 x blocks - 1), the last block (resident by default) not gathered
      again; reentrant checkpointing runs the blocks' forward under no_grad, which reshards every unit (a forward
      without grad), the last block too, so its recomputation gathers it again; and reduce-scatter between Ψ and
      the padded Ψ (each unit's gradients once);
    - losses, norms and final weights equal the single-process reference trained WITHOUT checkpointing."""
    model = make_stack(CKPT_BLOCKS)
    root = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks."))
    block = sum(p.numel() for p in model.blocks[0].parameters())
    psi = root + CKPT_BLOCKS * block
    root_p, block_p = _padded(root, world_size), _padded(block, world_size)
    prefetch = 1
    peak_bound = 4 * (root_p + (prefetch + 2) * block_p)
    backward_blocks = CKPT_BLOCKS - (ckpt == "non_reentrant")  # blocks gathered again for the backward
    ag_bound, rs_bound = root_p + (CKPT_BLOCKS + backward_blocks) * block_p, root_p + CKPT_BLOCKS * block_p
    ranks = dist_results(world_size, f"user-ckpt-{ckpt}")
    problems = []
    for r, res in enumerate(ranks):
        peak = res["gathered_params_peak"]
        if peak > peak_bound:
            problems.append(f"rank {r}: {peak} bytes gathered at the peak, bound root + {prefetch + 2} blocks = "
                            f"{peak_bound} (whole model: {4 * (root_p + CKPT_BLOCKS * block_p)})")
        for step, comm in enumerate(res["comm"]):
            ag = comm.get("all_gather", {}).get("elements", 0)
            rs = comm.get("reduce_scatter", {}).get("elements", 0)
            if not psi <= ag <= ag_bound:
                problems.append(f"rank {r} step {step}: all-gather {ag} elements, want Ψ={psi} <= . <= forward + "
                                f"backward = {ag_bound}")
            if not psi <= rs <= rs_bound:
                problems.append(f"rank {r} step {step}: reduce-scatter {rs} elements, want Ψ={psi} <= . <= {rs_bound}")
    problems += run_problems(ranks, ref_stack(STEPS, world_size, ckpt_blocks=CKPT_BLOCKS), world_size)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------------- item 6
@pytest.mark.parametrize("stage,mode", SAVE_CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_save_checkpoint_mid_accumulation(dist_results, world_size, stage, mode):
    """Issue #11 item 6: GPT-2, accumulation 2, engine.save_checkpoint(dir) after each step's first micro-batch
    backward (mode "no_sync": inside no_sync(), the usual recipe; mode "sync": stage 1 without no_sync, so the
    first backward already reduced), then the last micro-batch, clip, step: norms, losses and final weights equal
    the single-process reference (the save must not finalise -- average -- gradients that are still
    accumulating)."""
    ranks = dist_results(world_size, f"save-mid-accum-s{stage}-{mode}")
    for r, res in enumerate(ranks):
        assert res["saved"] == [True] * STEPS, f"rank {r}: checkpoint folder missing after save: {res['saved']}"
    check_run(ranks, reference_train("gpt2", "full", STEPS, ACCUM), world_size)


# ------------------------------------------------------------------------------------------------------- item 7
# A launcher process imports torch and hf_zero once (and builds one optimizer: torch.optim imports torch._dynamo on
# first use, ~1.5 s), then forks every rank of every run from that state.  Each forked rank is a fresh process with
# its own FileStore and process group; it runs the short script and leaves with sys.exit(0), i.e. through a normal
# interpreter exit (atexit handlers, finalisation, static destructors), as a script does.  Forking keeps a run at a
# fraction of a second instead of ~3 s of imports per process.
_SHORT_LAUNCHER = textwrap.dedent("""
    import datetime, json, os, signal, sys
    import torch, torch.distributed as dist
    from torch import nn
    from hf_zero import ZeroConfig, shard_model

    n_runs, world_size, tmp = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # pay torch.optim's lazy imports once, before forking


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(7, 13)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(3))
            self.out = nn.Linear(13, 5)

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.out(h)


    def short_script(rank, store_path, stage):
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        model = Net()
        engine = shard_model(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ZeroConfig(stage=stage))
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
        engine.backward(model(x).pow(2).mean())
        engine.clip_grad_norm_(1.0)
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        sd = engine.full_state_dict()
        assert (len(sd) == 10) if rank == 0 else (sd == {}), len(sd)
        dist.destroy_process_group()


    codes = []
    for run in range(n_runs):
        stage = 3 if run % 2 == 0 else 2
        pids = []
        for rank in range(world_size):
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the rank: stderr to a file, run, exit like a script
                fd = os.open(os.path.join(tmp, f"run{run}_rank{rank}.err"), os.O_WRONLY | os.O_CREAT, 0o644)
                os.dup2(fd, 2)
                short_script(rank, os.path.join(tmp, f"store{run}"), stage)
                sys.exit(0)
            pids.append(pid)
        for rank, pid in enumerate(pids):
            _, status = os.waitpid(pid, 0)
            codes.append([run, stage, rank, os.waitstatus_to_exitcode(status)])
    print(json.dumps(codes))
""")
SHORT_RUNS = 20  # alternating stage 3 and stage 2, 3 ranks each (a normal exit with torch loaded takes ~1 s)
SHORT_WORLD = 3
SHORT_TIMEOUT_S = 300


@pytest.mark.slow
def test_short_scripts_exit_cleanly():
    """Issue #11 item 7: 20 runs of a short 3-rank script (stage 3 and stage 2 alternating): build the engine,
    1 step, full_state_dict(), dist.destroy_process_group() right away, exit.  Every rank (a fresh process, see
    _SHORT_LAUNCHER) must exit with code 0 (the report: SIGABRT (-6) about twice in thirty runs under load)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tmp = tempfile.mkdtemp(prefix="hfz_short_")
    try:
        proc = subprocess.Popen([sys.executable, "-c", _SHORT_LAUNCHER, str(SHORT_RUNS), str(SHORT_WORLD), tmp],
                                cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # the launcher and its ranks form one process group
        try:
            out, err = proc.communicate(timeout=SHORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the launcher's own group: it and the ranks it forked
            out, err = proc.communicate()
            pytest.fail(f"the runs did not finish within {SHORT_TIMEOUT_S} s (a rank hung):\n{err[-2000:]}")
        assert proc.returncode == 0, f"launcher failed ({proc.returncode}):\n{err[-3000:]}"
        codes = json.loads(out.strip().splitlines()[-1])
        assert len(codes) == SHORT_RUNS * SHORT_WORLD
        failures = []
        for run, stage, rank, code in codes:
            if code != 0:
                with open(os.path.join(tmp, f"run{run}_rank{rank}.err")) as f:
                    tail = "\n".join(f.read().strip().splitlines()[-6:])
                failures.append(f"run {run} (stage {stage}) rank {rank}: exit code {code}\n{tail}")
        bad_runs = len({c[0] for c in codes if c[3] != 0})
        assert not failures, (f"{bad_runs} of {SHORT_RUNS} runs had a rank that did not exit 0:\n"
                              + "\n\n".join(failures))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ item 3, stage 3
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_stage3_unit_skipped_by_some_ranks_names_the_unit(dist_results, world_size):
    """Issue #11 item 3 (stage 3): a whole unit that odd ranks skip changes their all-gathers; with
    debug_collectives every rank gets a CollectiveMismatchError that names the skipped unit ("branch")."""
    ranks = dist_results(world_size, "skipped-unit-debug-s3")
    for r, res in enumerate(ranks):
        assert res["error"] == "CollectiveMismatchError", f"rank {r}: {res}"
        assert "unit branch" in res["message"] and "skipped or repeated a unit" in res["message"], res["message"]


# ------------------------------------------------------------------------------------------------------- item 4
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_stats_counts_trainable_and_frozen_apart(dist_results, world_size, stage):
    """Issue #11 item 4: params = params_trainable + params_frozen, each the model's own bytes of that kind (at
    stage 3 a 1/N share), within the padding of one group per parameter tensor."""
    for r, res in enumerate(dist_results(world_size, f"memory-split-s{stage}")):
        st = res["stats"]
        assert st["params"] == st["params_trainable"] + st["params_frozen"], st
        share = world_size if stage == 3 else 1
        for kind in ("trainable", "frozen"):
            want = res[kind] / share
            pad = res["tensors"][kind] * world_size * 4  # each flat group pads to a multiple of N elements
            got = st[f"params_{kind}"]
            assert want - pad <= got <= want + pad, f"rank {r} stage {stage} {kind}: {got} vs {want} (+-{pad})"


# ------------------------------------------------------------------------------------- mixed precision, stages 1/2
@pytest.mark.parametrize("stage", (1, 2))
def test_save_pretrained_under_mixed_precision_warns_where_the_master_is(tmp_path, stage):
    """Issue #11 ("What must hold"): at stages 1/2 under bf16 the model's parameters are the bf16 compute copy;
    save_pretrained on it warns that the fp32 master lives in the optimizer and names accelerator.save_model,
    while engine.full_state_dict() (the fp32 weights) does not warn and returns fp32 tensors."""
    import warnings

    from hf_zero import ZeroConfig, shard_model

    model = models.make_model("gpt2")
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=stage, mixed_precision="bf16"))
    try:
        assert next(model.parameters()).dtype == torch.bfloat16
        with pytest.warns(UserWarning, match=r"fp32 master weights live in the ZeRO optimizer.*accelerator.save_model"):
            model.save_pretrained(tmp_path / "out")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sd = engine.full_state_dict()
        assert sd["transformer.h.0.mlp.c_fc.weight"].dtype == torch.float32
    finally:
        engine.close()
