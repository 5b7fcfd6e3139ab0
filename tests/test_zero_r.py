"""ZeRO-R and offload: activation checkpointing (on / partitioned / CPU) and optimizer / parameter offload train
exactly like plain single-process training without either.

Scenarios run at world size 3 (padding everywhere) through the same recipe as test_engine_equivalence: a tiny
GPT-2 (tied) or Llama (untied), 4 AdamW steps x 3 accumulated micro-batches, clipping.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import models
from _dist import DistResults
from _recipe import ACCUM, STEPS, engine_train, reference_train
from test_engine_equivalence import check_against_reference

WORLD = 3
STAGES = (1, 2, 3)
# (mode, cpu_checkpointing): "partitioned" with pure data parallelism has no model-parallel group to split across
CHECKPOINTING = {"on": ("on", False), "cpu": ("on", True), "partitioned": ("partitioned", False),
                 "partitioned-cpu": ("partitioned", True)}
OFFLOAD = {"opt": dict(offload_optimizer="cpu"), "opt-params": dict(offload_optimizer="cpu", offload_params="cpu")}


def _kind(stage, i):
    return models.KINDS[(stage + i) % len(models.KINDS)]  # both model families over the combinations


def scenarios_for(world_size):
    sc = [(f"ckpt-{name}-s{stage}", engine_train, dict(kind=_kind(stage, i), stage=stage, zero_checkpointing=ck))
          for stage in STAGES for i, (name, ck) in enumerate(CHECKPOINTING.items())]
    sc += [(f"offload-{name}-s{stage}", offload_train, dict(kind=_kind(stage, i), stage=stage, **kw))
           for i, (name, kw) in enumerate(OFFLOAD.items()) for stage in STAGES
           if stage == 3 or "offload_params" not in kw]
    sc += [(f"offload-staged-s{stage}", staged_train, dict(kind=_kind(stage, 0), stage=stage)) for stage in (2, 3)]
    return sc


def staged_train(rank, world_size, kind, stage):
    """Offload with every reduced range going to the host gradient shard through the staging queue a GPU uses
    (engine/host_grads.py: here host and device are one memory, so the queue is forced on), counting the adds that
    went through it and the most that were still pending when the optimizer read the shards."""
    from hf_zero.engine.host_grads import HostGradients

    seen = {"staged": 0, "pending_at_step": 0}

    class Counting(HostGradients):
        def add(self, target, reduced):
            seen["staged"] += 1
            super().add(target, reduced)

    def stage_every_add(engine):
        sink = Counting(staged=True)
        engine.reducer.into_shards = sink
        engine.optimizer.register_step_pre_hook(
            lambda *_: seen.__setitem__("pending_at_step", max(seen["pending_at_step"], len(sink.pending))))

    out = engine_train(rank, world_size, kind, stage=stage, offload_optimizer="cpu", after_shard=stage_every_add)
    out["staging"] = seen
    return out


@pytest.fixture(scope="module")
def dist_results():
    return DistResults(scenarios_for)


def offload_train(rank, world_size, kind, stage, **offload):
    """The recipe with offload, plus, counted through the optimizer's public API, the storages the step reads and
    writes (master segments, optimizer states) and their devices."""
    probe = {}
    real_step = torch.optim.AdamW.step

    def counting_step(opt, *args, **kwargs):
        if opt.state:  # AdamW makes its states in the first step: count from the second on
            tensors = [p for g in opt.param_groups for p in g["params"]]
            tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
            probe["devices"] = sorted({str(t.device) for t in tensors})
            probe["bytes"] = _storage_bytes(tensors)
        return real_step(opt, *args, **kwargs)

    torch.optim.AdamW.step = counting_step
    try:
        out = engine_train(rank, world_size, kind, stage=stage, probe_step=STEPS - 1, **offload)
    finally:
        torch.optim.AdamW.step = real_step
    out["step_tensors"] = probe
    return out


def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("name,stage", [(n, s) for n, kw in OFFLOAD.items() for s in STAGES
                                        if s == 3 or "offload_params" not in kw])
def test_offload_matches_plain_training_and_places_states_on_host(dist_results, name, stage):
    i = list(OFFLOAD).index(name)
    kind = _kind(stage, i)
    ranks = dist_results(WORLD, f"offload-{name}-s{stage}")
    check_against_reference(ranks, reference_train(kind, "full", STEPS, ACCUM), WORLD)
    model = models.make_model(kind)
    psi = sum(p.numel() for p in model.parameters())  # every parameter trains; tied weights counted once
    for r, res in enumerate(ranks):
        step, stats = res["step_tensors"], res["memory"]["stats"]
        assert step["devices"] == ["cpu"], f"rank {r}: the offloaded step ran on {step['devices']}"
        # fp32 master (4 B) + AdamW's exp_avg and exp_avg_sq (8 B) per owned element, padding at most one
        # element per parameter tensor and group (and AdamW's scalar step counters)
        assert 12 * psi / WORLD <= step["bytes"] <= 12 * (psi / WORLD + 64), (r, step["bytes"], psi)
        params_host = stats["params"] if "offload_params" in OFFLOAD[name] else 0
        # stages 2/3 keep the fp32 gradient shard in host memory too (ZeRO-Offload): 4 B per owned element
        grads_host = stats["grads"] if stage >= 2 else 0
        if grads_host:
            assert 4 * psi / WORLD <= grads_host <= 4 * (psi / WORLD + 64), (r, grads_host, psi)
        assert stats["offloaded"] == step["bytes"] + params_host + grads_host, (r, stats)
        if params_host:  # stage 3 parameter shards: 4 B per owned element
            assert 4 * psi / WORLD <= params_host <= 4 * (psi / WORLD + 64)


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_through_the_staging_queue_matches_plain_training(dist_results, stage):
    """The GPU's path to host gradient shards (pinned staging, adds behind events) leaves the training exact: the
    reducer drains the queue before the clip and the step read the shards."""
    ranks = dist_results(WORLD, f"offload-staged-s{stage}")
    check_against_reference(ranks, reference_train(_kind(stage, 0), "full", STEPS, ACCUM), WORLD)
    for r, res in enumerate(ranks):
        assert res["staging"]["staged"] > 0, f"rank {r}: no add went through the queue"
        assert res["staging"]["pending_at_step"] == 0, f"rank {r}: the step read shards with copies pending"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", list(CHECKPOINTING))
def test_checkpointing_matches_plain_training(dist_results, name, stage):
    i = list(CHECKPOINTING).index(name)
    ranks = dist_results(WORLD, f"ckpt-{name}-s{stage}")
    calls = [res["layer_calls_per_micro_batch"] for res in ranks]
    assert calls == [2.0] * WORLD, f"decoder layers ran {calls} times per micro-batch: no recomputation"
    check_against_reference(ranks, reference_train(_kind(stage, i), "full", STEPS, ACCUM), WORLD)


# ------------------------------------------------------------------------------------- P_a with tensor parallelism
# World 4 = 2 data-parallel x 2 tensor-parallel ranks. A Megatron-style stack (column-parallel fc1, row-parallel fc2)
# whose TP shards are slices of a dense model; ZeRO shards over the data-parallel group, P_a over the TP group.
TP_WORLD, TP = 4, 2
TP_STEPS, TP_ACCUM, TP_ROWS, TP_SEQ = 3, 2, 4, 6  # rows of the global micro-batch
VOCAB, HIDDEN, FFN, LAYERS = 32, 8, 16, 3
TP_CASES = {"s1": (1, False), "s2": (2, False), "s2-cpu": (2, True), "s3": (3, False)}


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; the backward sums the TP ranks' input gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: the forward sums the TP ranks' partial outputs; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Block(torch.nn.Module):
    """x + fc2(gelu(fc1(ln(x)))) + b2, with fc1 split by rows and fc2 by columns over `group` (None: dense).
    Follows Transformers' checkpointing convention, so hf_zero's enable_activation_checkpointing covers it."""

    gradient_checkpointing = False

    def __init__(self, group=None, parts=1):
        super().__init__()
        self.group = group
        self.ln = torch.nn.LayerNorm(HIDDEN)
        self.fc1 = torch.nn.Linear(HIDDEN, FFN // parts)
        self.fc2 = torch.nn.Linear(FFN // parts, HIDDEN, bias=False)
        self.b2 = torch.nn.Parameter(torch.zeros(HIDDEN))

    def _block(self, x):
        y = self.ln(x)
        if self.group is not None:
            y = _CopyToTP.apply(y, self.group)
        y = self.fc2(torch.nn.functional.gelu(self.fc1(y)))
        if self.group is not None:
            y = _ReduceFromTP.apply(y, self.group)
        return x + y + self.b2

    def forward(self, x):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return self._gradient_checkpointing_func(self._block, x)
        return self._block(x)


class TPModel(torch.nn.Module):
    def __init__(self, group=None, parts=1):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block(group, parts) for _ in range(LAYERS))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def dense_model():
    torch.manual_seed(5)
    model = TPModel()
    with torch.no_grad():
        for blk in model.blocks:
            blk.b2.normal_(0, 0.1)
    return model


def tp_slice(name, tensor, t):
    """The TP rank `t`'s piece of a dense parameter (fc1: rows; fc2: columns; the rest replicated)."""
    f = FFN // TP
    if ".fc1." in name:
        return tensor[t * f:(t + 1) * f]
    if ".fc2." in name:
        return tensor[:, t * f:(t + 1) * f]
    return tensor


def tp_batches():
    gen = torch.Generator().manual_seed(11)
    return [[torch.randint(0, VOCAB, (TP_ROWS, TP_SEQ), generator=gen) for _ in range(TP_ACCUM)]
            for _ in range(TP_STEPS)]


def _tp_optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def tp_train(rank, world_size, stage, cpu):
    import torch.distributed as dist
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.engine.activations import enable_activation_checkpointing

    t, d = rank % TP, rank // TP
    tp_groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world_size // TP)]
    dp_groups = [dist.new_group([j, j + TP]) for j in range(TP)]
    tp, dp = tp_groups[d], dp_groups[t]
    dense = dense_model()
    model = TPModel(tp, TP)
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), dense.parameters()):
            p.copy_(tp_slice(name, q, t))
    out = {"saved": {}}
    # bytes the block stack saves for backward, counted from outside (P_a hands its pieces on to outer hooks)
    for mode in ("on", "partitioned"):
        enable_activation_checkpointing(model, mode, cpu, model_parallel_group=tp)
        nbytes, devices = [0], set()

        def pack(x):
            nbytes[0] += x.numel() * x.element_size()
            devices.add(str(x.device))
            return x

        h = model.embed(tp_batches()[0][0])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            for blk in model.blocks:
                h = blk(h)
        h.sum().backward()
        model.zero_grad(set_to_none=True)
        out["saved"][mode] = {"bytes": nbytes[0], "devices": sorted(devices)}
    enable_activation_checkpointing(model, "partitioned", cpu, model_parallel_group=tp)
    engine = shard_model(model, _tp_optimizer(model), ZeroConfig(stage=stage, units=[Block]), process_group=dp)
    losses = []
    for step in tp_batches():
        total = 0.0
        for mb in step:
            x = mb[d * (TP_ROWS // 2):(d + 1) * (TP_ROWS // 2)]
            loss = engine.model(x)
            engine.backward(loss / TP_ACCUM)
            total += loss.item() / TP_ACCUM
        engine.optimizer.step()
        engine.optimizer.zero_grad()
        losses.append(total)
    sd = engine.full_state_dict()
    out.update(losses=losses, state={k: v.clone() for k, v in sd.items()} if d == 0 else None)
    engine.close()
    return out


def tp_reference():
    model = dense_model()
    opt = _tp_optimizer(model)
    losses = []
    for step in tp_batches():
        total = 0.0
        for mb in step:
            loss = model(mb)
            (loss / TP_ACCUM).backward()
            total += loss.item() / TP_ACCUM
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


_base_scenarios = scenarios_for


def scenarios_for(world_size):  # noqa: F811 - the TP and C_B worlds add their own scenarios
    if world_size == CB_WORLD:
        return [(f"cb-s{stage}-l{layers}", cb_train, dict(stage=stage, layers=layers))
                for stage in (2, 3) for layers in CB_LAYERS]
    if world_size == TP_WORLD:
        return [(f"tp-{name}", tp_train, dict(stage=s, cpu=cpu)) for name, (s, cpu) in TP_CASES.items()]
    return _base_scenarios(world_size)


@pytest.mark.parametrize("name", list(TP_CASES))
def test_partitioned_checkpoints_with_tensor_parallelism(dist_results, name):
    ranks = dist_results(TP_WORLD, f"tp-{name}")
    cpu = TP_CASES[name][1]
    # saved checkpoints per rank: one layer input (rows x seq x hidden fp32) per block, split in TP pieces by P_a
    full = LAYERS * TP_ROWS * TP_SEQ * HIDDEN * 4
    for r, res in enumerate(ranks):
        assert res["saved"]["on"]["bytes"] == full, (r, res["saved"])
        assert res["saved"]["partitioned"]["bytes"] * TP == full, (r, res["saved"])
        if cpu:
            assert res["saved"]["partitioned"]["devices"] == ["cpu"]
    ref_losses, ref_state = tp_reference()
    for t in range(TP):  # each data-parallel rank reports its half's mean: the global mean is their average
        mean = (torch.tensor(ranks[t]["losses"]) + torch.tensor(ranks[t + TP]["losses"])) / 2
        torch.testing.assert_close(mean, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for t in range(TP):  # data-parallel rank 0 of each TP rank holds that TP shard's full state
        got = ranks[t]["state"]
        assert got is not None and set(got) == set(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(got[k], tp_slice(k, v, t), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, t=t: f"TP rank {t}: {k} differs from the dense run\n{m}")


# ------------------------------------------------------------------------------------------------------ C_B and M_D
CB_WORLD, CB_LAYERS, CB_BUCKET = 2, (4, 12), 16 * 1024


class _FlatAllocations(TorchDispatchMode):
    """Records every 1-D tensor of at least 512 elements that any torch op allocates (flat buckets and buffers;
    parameter gradients and activations are n-D)."""

    FACTORIES = (torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default,
                 torch.ops.aten.empty_strided.default)

    def __init__(self):
        super().__init__()
        self.nbytes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.FACTORIES and out.dim() == 1 and out.numel() >= 512:
            self.nbytes.append(out.numel() * out.element_size())
        return out


def cb_train(rank, world_size, stage, layers):
    """GPT-2 widths of models.py with `layers` blocks; per step: flat allocations, the engine's reported buffer
    bytes, and the largest total of materialised parameter storage seen from the model's own parameters."""
    from transformers import AutoModelForCausalLM

    from hf_zero import ZeroConfig, shard_model

    config = models._config("gpt2")
    config.n_layer = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    params = list(model.parameters())
    seen = [0]

    def observe(*_):
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
        seen[0] = max(seen[0], sum(storages.values()))

    for m in model.modules():
        m.register_forward_pre_hook(observe)
        m.register_forward_hook(observe)
    for p in params:
        p.register_hook(lambda g: observe() or g)
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=stage, reduce_bucket_size=CB_BUCKET))
    steps = []
    for step in models.make_batches(3, 2):
        seen[0] = 0
        allocs = _FlatAllocations()
        with allocs:
            for mb in step:
                x = models.rank_slice(mb, rank, world_size)
                engine.backward(engine.model(input_ids=x, labels=x).loss)
            engine.optimizer.step()
            engine.optimizer.zero_grad()
        stats = engine.memory_stats()
        steps.append({"flat_allocs": allocs.nbytes, "param_storage_peak": seen[0],
                      **{k: stats[k] for k in ("comm_buffers", "comm_buffer_allocations", "gathered_params_peak")}})
    engine.close()
    return steps


@pytest.mark.parametrize("stage", (2, 3))
def test_constant_buffers_and_no_allocations_after_the_first_step(dist_results, stage):
    """C_B: buckets and gather buffers do not grow with the model (4 vs 12 blocks of the same width); M_D: after the
    first step, no flat buffer is allocated again, and the engine's allocation count stops growing."""
    runs = {layers: dist_results(CB_WORLD, f"cb-s{stage}-l{layers}") for layers in CB_LAYERS}
    for layers, ranks in runs.items():
        for r, steps in enumerate(ranks):
            assert steps[0]["flat_allocs"], f"{layers} layers, rank {r}: the first step allocated no flat buffer"
            for i, st in enumerate(steps[1:], start=2):
                assert st["flat_allocs"] == [], f"{layers} layers, rank {r}, step {i}: allocated {st['flat_allocs']}"
                assert st["comm_buffer_allocations"] == steps[0]["comm_buffer_allocations"]
    small, big = runs[CB_LAYERS[0]], runs[CB_LAYERS[1]]
    for r in range(CB_WORLD):
        a, b = small[r][-1], big[r][-1]
        assert sorted(small[r][0]["flat_allocs"]) == sorted(big[r][0]["flat_allocs"])  # measured
        assert (a["comm_buffers"], a["gathered_params_peak"]) == (b["comm_buffers"], b["gathered_params_peak"])
        assert a["comm_buffers"] <= 4 * CB_BUCKET + 2 * max(small[r][0]["flat_allocs"])  # the reducer's bound
        if stage == 3:  # what the model's parameters point at, at most: the resident units (the root and, by
            # default, the last block) plus the unit(s) in flight
            assert a["param_storage_peak"] == b["param_storage_peak"] == a["gathered_params_peak"], (a, b)
