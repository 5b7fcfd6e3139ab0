"""`generate()` on a stage-3 sharded model against the stock single-process model (issue #20, "Keep").

The three ways a stage-3 model may generate on every rank, each compared token for token with plain Hugging Face
`generate()` (greedy) of the same weights in one process that never imports hf_zero:

- inside `engine.gathered_parameters()`, prompt lengths and new-token counts differing per rank;
- without the block, the same lengths on every rank (every forward gathers its units);
- without the block, lengths differing per rank, with Transformers' `synced_gpus=True` (finished ranks keep running
  dummy forwards so that the gathers line up).

GPT-2 (tied embeddings) and Llama, world sizes 2 and 3: one spawn per world size runs every case of both models.
After each case the sharded model's loss on a batch must still equal the reference's (the collectives line up
again), and no unit may be left gathered.
"""
import copy

import pytest
import torch

import models
from _dist import DistResults

pytestmark = pytest.mark.slow  # one spawn per world size: about 20 s (2 ranks) and 30 s (3 ranks) on 2 cores

WORLDS = (2, 3)
# name: (inside gathered_parameters(), prompt length of rank r, new tokens of rank r, extra generate() kwargs)
CASES = {
    "gathered_uneven": (True, lambda r: 3 + 2 * r, lambda r: 2 + 3 * r, {}),
    "equal": (False, lambda r: 5, lambda r: 4, {}),
    "synced_uneven": (False, lambda r: 3 + 2 * r, lambda r: 2 + 3 * r, {"synced_gpus": True}),
}


def _prompt(rank, length, case):
    """Two rows, tokens 1..VOCAB-1 (0 is eos/pad), different on every rank and in every case."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * length + len(case))
    return torch.randint(1, models.VOCAB, (2, length), generator=gen)


def _greedy(model, prompt, new, **kw):
    # min_new_tokens: eos (token 0) may not end a row early, so every rank runs exactly `new` decoding forwards
    return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)


# -------------------------------------------------------------------------------------------- scenario (workers)
def generate_cases(rank, world_size, kind):
    from hf_zero import ZeroConfig, shard_model

    model = models.make_model(kind)
    models.assert_no_dropout(model)
    reference = copy.deepcopy(model).eval()  # the stock model: same weights, one process, no hooks
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=3))
    model.eval()
    x = models.rank_slice(models.make_batches(1, 1)[0][0], rank, world_size)
    out = {}
    for name, (inside, length, new, kw) in CASES.items():
        prompt = _prompt(rank, length(rank), name)
        before = engine.comm_stats().get("all_gather", {}).get("calls", 0)
        with torch.no_grad():
            if inside:
                with engine.gathered_parameters():
                    got = _greedy(model, prompt, new(rank), **kw)
            else:
                got = _greedy(model, prompt, new(rank), **kw)
            gathers = engine.comm_stats().get("all_gather", {}).get("calls", 0) - before
            want = _greedy(reference, prompt, new(rank), **kw)
            loss = float(model(input_ids=x, labels=x).loss)
            ref_loss = float(reference(input_ids=x, labels=x).loss)
        out[name] = {"got": got, "want": want, "prompt_len": prompt.shape[1], "gathers": gathers,
                     "left_gathered": engine.memory_stats()["gathered_params"], "loss": loss, "ref_loss": ref_loss}
    return out


def scenarios_for(world_size):
    return [(kind, generate_cases, {"kind": kind}) for kind in models.KINDS]


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


# ---------------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", models.KINDS)
@pytest.mark.parametrize("world", WORLDS)
def test_stage3_generate_matches_stock_generate(dist_results, world, kind, case):
    inside, length, new, _ = CASES[case]
    res = dist_results(world, kind)
    for rank, r in enumerate(res):
        r = r[case]
        assert r["prompt_len"] == length(rank)
        assert r["got"].shape == (2, length(rank) + new(rank)), r["got"].shape  # the ranks' lengths really differ
        assert torch.equal(r["got"], r["want"]), (
            f"world {world} {kind} {case} rank {rank}: hf_zero stage 3\n{r['got']}\nstock\n{r['want']}")
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), (r["loss"], r["ref_loss"])
        assert r["left_gathered"] == 0, f"rank {rank}: {r['left_gathered']} bytes left gathered after {case}"
        if not inside:  # the `new` forwards really ran on sharded parameters, gathering 3 units each
            assert r["gathers"] >= 3 * new(rank), r["gathers"]
    if case == "synced_uneven":  # the finished ranks kept gathering with the others: same number everywhere
        assert len({r[case]["gathers"] for r in res}) == 1, [r[case]["gathers"] for r in res]
