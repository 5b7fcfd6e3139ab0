"""Issue #45 item 2: a parameter with no gradient is not stepped, as with stock torch.optim.AdamW and DDP.

Stock semantics (the reference here is plain single-process PyTorch on the same batches):
- after `zero_grad(set_to_none=True)`, a parameter that got no gradient has `.grad is None`, and AdamW skips it: no
  weight decay, no momentum, and its step count does not advance (which changes its next real update);
- `optimizer.step()` with no backward since `zero_grad(set_to_none=True)` changes nothing;
- DDP leaves the gradient of a parameter that no rank used untouched (None), while a parameter that some rank used
  gets the average, zeros included from the ranks that did not (test_real_code.py's rank-dependent case);
- after `zero_grad(set_to_none=False)` every parameter has a zero gradient, and AdamW steps all of them.

Each scenario is a program of steps run by the engine (W = 1, 2, 3; stages 0-3) and by the reference; the blocks'
`extra` sub-modules are used in some steps and not in others (by every rank alike).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

import models
from _dist import DistResults
from test_real_code import make_stack, stack_batches, stack_optimizer

WORLD_SIZES = (1, 2, 3)
STAGES = (0, 1, 2, 3)
RTOL, ATOL = 1e-5, 1e-6

# A program: ("train", use_extra) is forward + backward + clip + step; ("step",) is optimizer.step() alone;
# ("zero", set_to_none) is optimizer.zero_grad(set_to_none=...).
Program = List[Tuple[Any, ...]]
PROGRAMS: Dict[str, Program] = {
    # the extra branch is used, then a step with no backward, then a step where no rank uses the branch, then used
    "set_to_none": [("train", True), ("zero", True), ("step",), ("zero", True), ("train", False), ("zero", True),
                    ("train", True), ("zero", True)],
    # the same with zero gradients kept: every parameter is stepped every time
    "zeros_kept": [("train", True), ("zero", False), ("step",), ("zero", False), ("train", False), ("zero", False),
                   ("train", True), ("zero", False)],
}
N_TRAIN = 3  # "train" entries per program


def _run(program: Program, optimizer, loss_of, clip, step_fn) -> None:
    """Run `program`; `loss_of(batch, use_extra)` is this process's loss (backward is called on it)."""
    batches = iter(stack_batches(N_TRAIN))
    for op in program:
        if op[0] == "train":
            loss_of(next(batches), op[1]).backward()
            clip()
            step_fn()
        elif op[0] == "step":
            step_fn()
        else:
            optimizer.zero_grad(set_to_none=op[1])


def reference(program: Program, world_size: int, zeros_for_unused: bool = False) -> Dict[str, Any]:
    """Plain torch: the loss is the mean of the ranks' losses on their slices. `zeros_for_unused`: what a buggy
    engine would compute (every parameter stepped with a zero gradient where it had none), to show the test can tell."""
    torch.manual_seed(0)
    model = make_stack(2, with_extra=True)
    opt = stack_optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_of(batch, use_extra):
        x, t = batch
        return sum(model(models.rank_slice(x, r, world_size), models.rank_slice(t, r, world_size),
                         use_extra=use_extra) for r in range(world_size)) / world_size

    def step():
        if zeros_for_unused:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        opt.step()

    _run(program, opt, loss_of, lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), step)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def sc_program(rank: int, world_size: int, name: str, stage: int) -> Dict[str, Any]:
    from hf_zero import ZeroConfig, shard_model

    torch.manual_seed(0)
    model = make_stack(2, with_extra=True)
    engine = shard_model(model, stack_optimizer(model), ZeroConfig(stage=stage, units=["RealCodeBlock"]))

    def loss_of(batch, use_extra):
        x, t = batch
        return model(models.rank_slice(x, rank, world_size), models.rank_slice(t, rank, world_size),
                     use_extra=use_extra)

    _run(PROGRAMS[name], engine.optimizer, loss_of, lambda: engine.clip_grad_norm_(1.0), engine.optimizer.step)
    sd = engine.full_state_dict()
    engine.close()
    return {k: v.detach().clone() for k, v in sd.items()} if rank == 0 else len(sd)


def scenarios_for(world_size: int):
    return [(f"{name}-s{stage}", sc_program, dict(name=name, stage=stage)) for name in PROGRAMS for stage in STAGES]


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


def _mismatches(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> List[str]:
    out = [f"missing {k}" for k in want if k not in got]
    for k, v in want.items():
        if k in got and not torch.allclose(got[k], v, rtol=RTOL, atol=ATOL):
            out.append(f"{k}: max |diff| {float((got[k] - v).abs().max()):.3g}")
    return out


def test_reference_tells_skipped_from_zero_stepped():
    """The reference is sensitive: stepping the unused parameters with zero gradients (what the engine did before)
    moves the `extra` weights far beyond the tolerance, and only those (and what depends on them later)."""
    right = reference(PROGRAMS["set_to_none"], 2)
    wrong = reference(PROGRAMS["set_to_none"], 2, zeros_for_unused=True)
    bad = _mismatches(wrong, right)
    assert any("extra" in m for m in bad), bad
    # and with zeros kept, stock AdamW itself steps every parameter: the two programs end in different places
    assert _mismatches(reference(PROGRAMS["zeros_kept"], 2), right)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_step_without_gradient_matches_stock(dist_results, world_size, name, stage):
    """After zero_grad(set_to_none=True) a parameter no rank used is skipped by the step, and a step with no
    backward changes nothing; after zero_grad(set_to_none=False) every parameter is stepped with zeros. Equal to
    plain AdamW on the same program."""
    ranks = dist_results(world_size, f"{name}-s{stage}")
    assert all(n == 0 for n in ranks[1:]), "full_state_dict is rank 0's"
    problems = _mismatches(ranks[0], reference(PROGRAMS[name], world_size))
    assert not problems, "\n".join(problems)
