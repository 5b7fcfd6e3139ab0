"""ZeRO stages 0-3 train exactly like plain single-process training.

For each world size, every scenario runs in one spawn of W gloo workers (see _dist.DistResults).  A scenario trains
a tiny GPT-2 (tied embeddings) or Llama (untied) for 4 AdamW steps with gradient accumulation 3 and clipping; the
reference trains the same model in this process on the concatenated global micro-batches.
"""
import pytest
import torch

import models
from _dist import DistResults
from _recipe import ACCUM, STEPS, engine_train, reference_train, state_mismatches

WORLD_SIZES = (1, 2, 3, 4)
STAGES = (0, 1, 2, 3)
RTOL, ATOL = 1e-5, 1e-6
EXTRA_WORLD = 3  # fine-tuning variants and activation checkpointing run here (padding at every buffer)
# The flat (NCCL-shaped) collectives on gloo (ZeroConfig.collectives="flat"): stages 1-3 at every world size > 1,
# one model kind each (stage 0 only all-reduces, which no strategy changes), in the spawns above.
FLAT_CASES = [(2, "gpt2"), (3, "llama"), (3, "gpt2"), (4, "llama")]
FLAT_STAGES = (1, 2, 3)
FLAT = {"collectives": "flat"}


def scenarios_for(world_size):
    sc = [(f"{kind}-full-s{stage}", engine_train, dict(kind=kind, stage=stage))
          for kind in models.KINDS for stage in STAGES]
    if world_size == EXTRA_WORLD:
        sc += [(f"{kind}-full-s3-ckpt", engine_train, dict(kind=kind, stage=3, checkpointing=True))
               for kind in models.KINDS]
        # a forward with grad that no backward follows (a metric in train mode) leaves units gathered over the step
        sc += [(f"{kind}-full-s3-stray", engine_train, dict(kind=kind, stage=3, stray_forward=True))
               for kind in models.KINDS]
        sc += [(f"{kind}-{variant}-s{stage}", engine_train, dict(kind=kind, variant=variant, stage=stage))
               for variant in ("frozen_emb", "lora") for kind in models.KINDS for stage in STAGES]
        sc += [(f"{kind}-full-s{stage}-sync-every", engine_train, dict(kind=kind, stage=stage,
                                                                        sync_every_micro_batch=True))
               for kind in models.KINDS for stage in STAGES]
    sc += [(f"{kind}-full-s{stage}-flat", engine_train, dict(kind=kind, stage=stage, zero_options=FLAT))
           for w, kind in FLAT_CASES if w == world_size for stage in FLAT_STAGES]
    return sc


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


def check_against_reference(ranks, ref, world_size):
    """Every rank's run against the reference: init, per-step losses, global norms, final full state."""
    assert len(ranks) == world_size
    # harness sanity: every rank built the very model the reference trained
    want_init = {k: float(v.double().sum()) for k, v in ref["init"].items()}
    for r, res in enumerate(ranks):
        assert res["same_model"], f"rank {r}: engine.model is not the model passed to shard_model"
        assert res["init_fp"] == {k: want_init[k] for k in res["init_fp"]}, f"rank {r}: different initial model"
    # loss: each rank has equal tokens, so the mean of the ranks' local means is the global mean
    losses = torch.tensor([res["losses"] for res in ranks], dtype=torch.float64).mean(0)
    torch.testing.assert_close(losses, torch.tensor(ref["losses"], dtype=torch.float64), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"per-step losses differ from the reference\n{m}")
    # clip_grad_norm_ returns the GLOBAL pre-clip norm, the same tensor value on every rank
    for r, res in enumerate(ranks):
        assert all(res["norm_is_tensor"]), f"rank {r}: clip_grad_norm_ did not return a tensor"
        torch.testing.assert_close(torch.tensor(res["norms"], dtype=torch.float64),
                                   torch.tensor(ref["norms"], dtype=torch.float64), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, r=r: f"rank {r}: global grad norms differ\n{m}")
    # final parameters: engine.full_state_dict() is the full fp32 state on rank 0 and {} elsewhere
    for r, res in enumerate(ranks[1:], start=1):
        assert res["state_len"] == 0, f"rank {r}: full_state_dict() returned {res['state_len']} entries, want {{}}"
    problems = state_mismatches(ranks[0]["state"], ref["state"], RTOL, ATOL)
    assert not problems, "final state differs from the reference:\n" + "\n".join(problems)


def test_models_need_padding_at_world_size_3():
    """The W=3 runs exercise padding.  Full models: the total, both param groups, each decoder layer (stage-3 unit)
    and the root unit have sizes not divisible by 3.  Fine-tuning variants: the trainable total and at least one
    param group (a frozen Llama embedding leaves a decoupled group divisible by 3; the other one is not)."""
    for kind in models.KINDS:
        for variant in models.VARIANTS:
            model = models.make_model(kind, variant)
            groups = {f"group{i}": sum(p.numel() for p in g["params"])
                      for i, g in enumerate(models.param_groups(model))}
            sizes = {"trainable": models.trainable_numel(model)}
            if variant == "full":
                sizes.update(groups)
                sizes["all"] = sum(p.numel() for p in model.parameters())
                units = models.unit_modules(model)
                assert len(units) == 2
                in_units = {id(p) for u in units for p in u.parameters()}
                sizes["root"] = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
                for i, u in enumerate(units):
                    sizes[f"unit{i}"] = sum(p.numel() for p in u.parameters())
            else:
                assert any(v % 3 for v in groups.values()), f"{kind}/{variant}: {groups}"
            divisible = {k: v for k, v in sizes.items() if v % 3 == 0}
            assert not divisible, f"{kind}/{variant}: sizes divisible by 3: {divisible}"


def test_reference_is_sensitive():
    """The reference recipe actually trains (the loss changes, clipping is active, every trainable param moves), so a
    silently skipped update, group or clip in the engine cannot match it."""
    for kind in models.KINDS:
        ref = reference_train(kind)
        assert len(set(ref["losses"])) == len(ref["losses"]), "the loss does not change between steps"
        assert max(ref["norms"]) > 1.0, "clip_grad_norm_(1.0) never clips"
        if kind == "gpt2":
            assert min(ref["norms"]) < 1.0, "gpt2 should also have unclipped steps"
        model = models.make_model(kind)
        for name, p in model.named_parameters():
            assert not torch.equal(ref["state"][name], ref["init"][name]), f"{kind}: {name} did not change"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_full_training_matches_reference(dist_results, world_size, kind, stage):
    ranks = dist_results(world_size, f"{kind}-full-s{stage}")
    assert [res["layer_calls_per_micro_batch"] for res in ranks] == [1.0] * world_size
    check_against_reference(ranks, reference_train(kind, "full", STEPS, ACCUM), world_size)


@pytest.mark.parametrize("kind", models.KINDS)
def test_stage3_activation_checkpointing_matches_reference(dist_results, kind):
    ranks = dist_results(EXTRA_WORLD, f"{kind}-full-s3-ckpt")
    calls = [res["layer_calls_per_micro_batch"] for res in ranks]
    assert calls == [2.0] * EXTRA_WORLD, f"decoder layers ran {calls} times per micro-batch: no recomputation"
    check_against_reference(ranks, reference_train(kind, "full", STEPS, ACCUM), EXTRA_WORLD)


@pytest.mark.parametrize("kind", models.KINDS)
def test_stage3_forward_without_backward_before_the_step(dist_results, kind):
    """A unit left gathered by a forward no backward followed is gathered again after the step changed it."""
    check_against_reference(dist_results(EXTRA_WORLD, f"{kind}-full-s3-stray"),
                            reference_train(kind, "full", STEPS, ACCUM), EXTRA_WORLD)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("variant", ["frozen_emb", "lora"])
def test_finetune_variants_match_reference(dist_results, variant, kind, stage):
    """Frozen embeddings (not in the optimizer) and a LoRA-shaped run (only small added params and the final norm
    train): frozen params must come back unchanged, trained ones as in the reference."""
    ref = reference_train(kind, variant, STEPS, ACCUM)
    frozen = [n for n, p in models.make_model(kind, variant).named_parameters() if not p.requires_grad]
    assert frozen and all(torch.equal(ref["state"][n], ref["init"][n]) for n in frozen)
    ranks = dist_results(EXTRA_WORLD, f"{kind}-{variant}-s{stage}")
    check_against_reference(ranks, ref, EXTRA_WORLD)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", models.KINDS)
def test_accumulation_without_no_sync_matches_reference(dist_results, kind, stage):
    """Every micro-batch's backward synchronises (no no_sync()): stage 0 accumulates onto averaged gradients,
    stage 1 onto its reduced owned range after the rest of the accumulator was used as reduction scratch."""
    ranks = dist_results(EXTRA_WORLD, f"{kind}-full-s{stage}-sync-every")
    check_against_reference(ranks, reference_train(kind, "full", STEPS, ACCUM), EXTRA_WORLD)


@pytest.mark.parametrize("stage", FLAT_STAGES)
@pytest.mark.parametrize("world_size,kind", FLAT_CASES)
def test_flat_collectives_match_reference(dist_results, world_size, kind, stage):
    """The collectives a GPU runs (one all_gather_into_tensor / reduce_scatter_tensor per bucket), run on gloo,
    padding included at world size 3: the same training as the reference, and the ledger per strategy says flat."""
    ranks = dist_results(world_size, f"{kind}-full-s{stage}-flat")
    assert all(res["collectives"] == ["flat"] for res in ranks), [res["collectives"] for res in ranks]
    for res in ranks:
        for plain, by_strategy in zip(res["comm"], res["comm_by_strategy"]):
            assert set(by_strategy) == {"flat"} and by_strategy["flat"]["total"] == plain["total"], by_strategy
    check_against_reference(ranks, reference_train(kind, "full", STEPS, ACCUM), world_size)
