"""`hf-zero bench` end to end: every system trains the tiny GPT-2 and reports; hf_zero's measured communication
matches the paper's formula up to padding; DeepSpeed's rows are measured when it is installed and skipped with the
reason when it is not; --plot writes the PNG. The hierarchical systems (zero3-hpz, zero2-hsdp) run on 4 ranks with
--ranks-per-host 2 and match their formulas, all of it intra-host on this one machine; a bad K skips their rows.

Ψ is counted here from the tiny preset's shapes (written out below, not read from hf_zero), so the check does not
trust the numbers the engine reports about itself; so are the model-state bytes each row measures, exactly
(hf_zero's flat groups and their padding by tests/_flat_layout.py, DDP's and FSDP2's tensors from the shapes).
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from transformers import AutoModelForCausalLM, GPT2Config

pytestmark = pytest.mark.slow  # one end-to-end bench run: ~70 s idle (DeepSpeed installed), more when loaded

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 2
GRAD_ACCUM = 1  # the command's default
HF_ZERO_SYSTEMS = ("zero0", "zero1", "zero2", "zero3")
REQUIRED_SYSTEMS = ("ddp", "fsdp2") + HF_ZERO_SYSTEMS
DEEPSPEED_SYSTEMS = ("deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3")
HIERARCHICAL_SYSTEMS = ("zero1-hsdp", "zero2-hsdp", "zero3-hsdp", "zero3-hpz")
H_WORLD, H_K = 4, 2  # the hierarchical runs: 4 ranks in (pretended) hosts of 2
DEEPSPEED_INSTALLED = importlib.util.find_spec("deepspeed") is not None  # installed must mean it runs
HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _tiny_model():
    # --preset tiny: a GPT-2 with 2 layers, width 64, vocabulary 512, 128 positions
    config = GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def _counts():
    """Ψ (distinct trainable elements: tied wte/lm_head once), the elements stage 3 keeps gathered from forward to
    backward under the default reshard_after_forward ("auto", torchtitan's): the root unit (everything outside the
    transformer blocks) and the last block, transformer.h.{L-1}; and the number of parameter tensors (a bound on
    the flat groups, hence on padding)."""
    model = _tiny_model()
    params = {id(p): (name, p) for name, p in model.named_parameters() if p.requires_grad}
    psi = sum(p.numel() for _, p in params.values())
    last = f"transformer.h.{model.config.n_layer - 1}."
    resident = sum(p.numel() for name, p in params.values()
                   if not name.startswith("transformer.h.") or name.startswith(last))
    return psi, resident, len(params)


def _run_bench(args, hide=(), hide_dir=None, timeout=600, world=WORLD, steps=2, warmup=1):
    """Run `hf-zero bench` in a subprocess; `hide`: modules made unimportable, as on a machine without them (a
    module of that name in `hide_dir`, first on PYTHONPATH, that raises ImportError)."""
    path = [ROOT]
    if hide:
        fake = str(hide_dir)
        os.makedirs(fake, exist_ok=True)
        for name in hide:
            with open(os.path.join(fake, f"{name}.py"), "w") as f:
                f.write(f"raise ImportError('{name} is hidden by the test')\n")
        path.insert(0, fake)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "hf_zero.cli", "bench", "--preset", "tiny", "--steps", str(steps), "--warmup",
           str(warmup), "--num-processes", str(world)] + list(args)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _read_json(path):
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    assert len(lines) == 1, "--json writes exactly one JSON line"
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    out, png = folder / "out.json", folder / "out.png"
    proc = _run_bench(["--json", str(out)] + (["--plot", str(png)] if HAVE_MATPLOTLIB else []))
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return _read_json(out), proc, png


def _assert_skipped_for_deepspeed(row):
    assert row["status"] == "skipped", row
    assert "deepspeed" in row["reason"] and "pip install" in row["reason"], row
    assert row.get("tokens_per_s") is None and row.get("x_ddp") is None, row


def test_every_system_has_a_row(bench):
    data, proc, _ = bench
    requested = data["settings"]["systems"]
    assert set(REQUIRED_SYSTEMS + DEEPSPEED_SYSTEMS) <= set(requested), requested
    assert not set(HIERARCHICAL_SYSTEMS) & set(requested), "the hierarchical systems are not part of `all`"
    rows = {r["system"]: r for r in data["rows"]}
    assert list(rows) == requested, "one row per requested system, in order"
    psi, _, _ = _counts()
    for name in requested:
        row = rows[name]
        assert name in proc.stdout, f"{name} missing from the table"
        if name in DEEPSPEED_SYSTEMS and not DEEPSPEED_INSTALLED:
            _assert_skipped_for_deepspeed(row)
            continue
        assert row["status"] == "ok", f"{name}: {row.get('error', row['status'])}"
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
        assert row["state_bytes_measured"] > 0 and row["state_bytes_formula"] > 0, row
        assert row["peak_bytes"] > 0, row
        assert row["psi"] == psi, f"{name} trained a model of {row['psi']} parameters, the tiny preset has {psi}"
        assert math.isfinite(row["x_ddp"]), row
    assert rows["ddp"]["x_ddp"] == pytest.approx(1.0)
    # same weights, same tokens, fp32: every system is at the same loss after the same two updates
    for name, row in rows.items():
        if row["status"] == "ok":
            assert row["loss_last_step"] == pytest.approx(rows["ddp"]["loss_last_step"], rel=1e-4), name


def _expected_state_bytes(system):
    """Model-state bytes of the rank holding the most, counted here (fp32 AdamW: parameters, gradients, two states
    per element, and torch's 4-byte `step` per parameter tensor): hf_zero stage k over its flat groups padded to
    the world size (tests/_flat_layout.py, from the preset's shapes, not hf_zero's planner); DDP whole on every
    rank; FSDP2 each parameter's dim-0 chunk of ceil(rows / WORLD) rows."""
    from _flat_layout import worst_rank_bytes

    model = _tiny_model()
    params = list(model.parameters())  # tied wte / lm_head once
    if system.startswith("zero"):
        return worst_rank_bytes(model, WORLD, int(system[4:]))["model_states"]
    if system == "ddp":
        return sum(16 * p.numel() + 4 for p in params)

    def local(p, rank):
        rows = -(-p.shape[0] // WORLD)
        return max(0, min(p.shape[0], (rank + 1) * rows) - rank * rows) * (p.numel() // p.shape[0])

    return max(sum(16 * local(p, r) + 4 for p in params) for r in range(WORLD))


def test_state_bytes_match_the_formula(bench):
    """Measured model-state bytes are the exact count made here from the preset's shapes (padding and AdamW's
    `step` tensors included), and the bench's formula column is the paper's fp32 formula over Ψ."""
    data, _, _ = bench
    psi, _, _ = _counts()
    paper = {0: 16 * psi, 1: 8 * psi + 8 * psi / WORLD, 2: 4 * psi + 12 * psi / WORLD, 3: 16 * psi / WORLD}
    checked = set()
    for row in data["rows"]:
        if row["system"] not in HF_ZERO_SYSTEMS + ("ddp", "fsdp2"):
            continue
        assert row["state_bytes_measured"] == _expected_state_bytes(row["system"]), row
        stage = {"ddp": 0, "fsdp2": 3}.get(row["system"], row["state_formula"]["stage"])
        assert row["state_bytes_formula"] == pytest.approx(paper[stage], rel=1e-12), row
        checked.add(row["system"])
    assert checked == set(HF_ZERO_SYSTEMS + ("ddp", "fsdp2"))


def test_hf_zero_comm_matches_the_formula(bench):
    data, _, _ = bench
    psi, resident, n_tensors = _counts()
    m = GRAD_ACCUM
    pad = n_tensors * (WORLD - 1)  # each flat group pads fewer than WORLD elements; there are at most n_tensors
    rows = {r["system"]: r for r in data["rows"]}

    def within(value, lo, hi, what):
        assert lo <= value <= hi, f"{what}: {value:,.0f} not in [{lo:,.0f}, {hi:,.0f}] (Ψ = {psi:,})"

    ddp = rows["ddp"]["comm_elements_measured_by_kind"]
    assert ddp == {"all_reduce": 2 * psi}, ddp  # the DDP comm hook sees every bucket once per step

    for stage in range(4):
        row = rows[f"zero{stage}"]
        kinds = row["comm_elements_measured_by_kind"]
        formula = row["comm_elements_formula_by_kind"]
        assert set(kinds) == set(formula), (stage, kinds, formula)
        if stage == 0:
            assert kinds == {"all_reduce": 2 * psi}
        elif stage in (1, 2):
            rs_mult = m if stage == 2 else 1
            within(kinds["reduce_scatter"], rs_mult * psi, rs_mult * (psi + pad), f"stage {stage} reduce-scatter")
            within(kinds["all_gather"], psi, psi + pad, f"stage {stage} all-gather")
        else:
            within(kinds["reduce_scatter"], m * psi, m * (psi + pad), "stage 3 reduce-scatter")
            # The paper's 2mΨ gathers every unit twice per micro-batch; hf_zero keeps its root unit (embeddings,
            # final norm, tied LM head) and, by default, the last block gathered from the forward into the backward
            # (reshard_after_forward "auto", as torchtitan does), so those are gathered once.
            within(kinds["all_gather"], m * (2 * psi - resident), m * (2 * psi + 2 * pad), "stage 3 all-gather")
        assert row["comm_elements_measured"] == pytest.approx(sum(kinds.values()))
        assert row["comm_elements_formula"] == pytest.approx(sum(formula.values()))
        total_formula = sum(formula.values())
        if stage == 3:  # the formula counts the resident root and last block as hf_zero runs them
            assert formula["all_gather"] == m * (2 * psi - resident), formula
        # one host: everything intra, measured and by the formula
        assert row["num_hosts"] == 1 and row["comm_elements_measured_inter"] == 0, row
        assert row["comm_elements_measured_intra"] == row["comm_elements_measured"], row
        assert row["comm_elements_formula_intra"] == pytest.approx(total_formula), row
        if stage < 3:
            within(row["comm_elements_measured"], total_formula, total_formula + 3 * m * pad, f"stage {stage} total")


@pytest.mark.needs_deepspeed  # CI installs DeepSpeed: a skip there fails (tests/conftest.py)
@pytest.mark.skipif(not DEEPSPEED_INSTALLED, reason="needs DeepSpeed: it is not installed (pip install deepspeed)")
def test_deepspeed_rows_are_measured(bench):
    """DeepSpeed's partitions shrink the rank's model states stage by stage, and its gradients are reduced once
    per step: the bytes and elements are DeepSpeed's own, counted by the bench, not a formula echoed back."""
    data, _, _ = bench
    psi, _, n_tensors = _counts()
    rows = {r["system"]: r for r in data["rows"]}
    ddp, z1, z3 = rows["ddp"], rows["deepspeed_zero1"], rows["deepspeed_zero3"]
    for row in (z1, rows["deepspeed_zero2"], z3):
        assert row["peer_version"].startswith("deepspeed "), row
        kinds = row["comm_elements_measured_by_kind"]
        assert kinds and set(kinds) <= {"all_gather", "reduce_scatter", "all_reduce", "reduce", "broadcast"}, kinds
        assert sum(kinds.values()) == pytest.approx(row["comm_elements_measured"])
    assert z3["state_bytes_measured"] < z1["state_bytes_measured"] < ddp["state_bytes_measured"]
    # stage 3 in fp32: parameter, gradient and master partitions (DeepSpeed keeps an fp32 master beside fp32
    # parameters) and two Adam states, 4 + 4 + 4 + 8 bytes per element over N, plus padding and `step` scalars
    slack = 20 * n_tensors * WORLD + 8 * n_tensors
    assert 0 <= z3["state_bytes_measured"] - 20 * psi / WORLD <= slack, z3["state_bytes_measured_by_kind"]
    z3_kinds = z3["comm_elements_measured_by_kind"]
    assert psi <= z3_kinds["reduce_scatter"] <= psi + n_tensors * WORLD, z3_kinds
    # gathered once (kept live from forward to backward) or twice per micro-batch
    assert psi <= z3_kinds["all_gather"] <= 2 * (psi + n_tensors * WORLD), z3_kinds
    assert z1["comm_elements_measured"] >= 2 * psi, z1  # gradients reduced, parameters gathered


def test_deepspeed_config_trains_like_the_other_systems():
    """Same batch, accumulation and precision, and no gradient clipping: DeepSpeed clips at 1.0 by default, which
    the tiny model's small gradients never reach (so the loss check above cannot see it) but GPT-2's do."""
    import torch

    from hf_zero.tools.bench.base import Settings, WorkerContext
    from hf_zero.tools.bench.deepspeed import deepspeed_config

    settings = Settings(model_config={}, model_name="tiny", steps=1, warmup=0, batch_size=3, seq_len=8, grad_accum=2,
                        mixed_precision="no", num_processes=WORLD, lr=1e-4, seed=0, timeout_s=60)
    config = deepspeed_config(WorkerContext(0, WORLD, torch.device("cpu"), settings), 3)
    assert config["gradient_clipping"] == 0.0
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (3, 2)
    assert config["train_batch_size"] == 3 * 2 * WORLD
    assert config["zero_optimization"]["stage"] == 3 and not config["bf16"]["enabled"]


def test_deepspeed_missing_rows_are_skipped_with_the_reason(tmp_path):
    """Where `import deepspeed` fails, its rows say so and the run succeeds (no worker is even started)."""
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    args = ["--systems", ",".join(DEEPSPEED_SYSTEMS), "--json", str(out)] + (
        ["--plot", str(png)] if HAVE_MATPLOTLIB else [])
    proc = _run_bench(args, hide=("deepspeed",), hide_dir=tmp_path / "hidden", timeout=300)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = _read_json(out)["rows"]
    assert [r["system"] for r in rows] == list(DEEPSPEED_SYSTEMS)
    for row in rows:
        _assert_skipped_for_deepspeed(row)
        assert "hidden by the test" in row["reason"], row
    assert proc.stdout.count("skipped: import deepspeed failed") == len(DEEPSPEED_SYSTEMS), proc.stdout
    assert not HAVE_MATPLOTLIB or png.stat().st_size > 0


@pytest.mark.needs_extras
def test_plot_is_a_png_of_the_declared_size(bench):
    matplotlib_image = pytest.importorskip("matplotlib.image", reason="--plot needs matplotlib")
    from hf_zero.tools.bench.plot import DPI, FIGSIZE

    _, proc, png = bench
    assert f"plot written to {png}" in proc.stderr
    pixels = matplotlib_image.imread(str(png))
    assert pixels.shape[:2] == (round(FIGSIZE[1] * DPI), round(FIGSIZE[0] * DPI)), pixels.shape
    assert pixels.shape[2] in (3, 4) and pixels.std() > 0, "an empty image"


def test_plot_without_matplotlib_is_a_clear_error_before_any_run(tmp_path):
    proc = _run_bench(["--systems", "ddp", "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "x.png")],
                      hide=("matplotlib",), hide_dir=tmp_path / "hidden", timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "--plot needs matplotlib" in proc.stderr and "pip install" in proc.stderr, proc.stderr
    assert "[1/1] ddp" not in proc.stderr, "the check comes before the benchmark"
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "x.png").exists()


# ------------------------------------------------------------------------------------------ hierarchical systems
@pytest.fixture(scope="module")
def hierarchical(tmp_path_factory):
    """zero3-hpz and zero2-hsdp on 4 ranks with K = 2, one step and no warm-up (the step's collectives are the same
    from the first one; 4 ranks on this machine take ~1 min, the reason the module is slow)."""
    out = tmp_path_factory.mktemp("bench_hier") / "out.json"
    proc = _run_bench(["--systems", "zero3-hpz,zero2-hsdp", "--ranks-per-host", str(H_K), "--json", str(out)],
                      world=H_WORLD, steps=1, warmup=0)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return {r["system"]: r for r in _read_json(out)["rows"]}, proc


def _within(value, lo, hi, what):
    assert lo <= value <= hi, f"{what}: {value:,.0f} not in [{lo:,.0f}, {hi:,.0f}]"


def _assert_one_host(row):
    """This machine is one host: no collective leaves it, measured or by the formula for the run's hosts."""
    assert (row["num_hosts"], row["host_size"]) == (1, H_WORLD), row
    assert row["comm_elements_measured_inter"] == 0 and row["comm_elements_formula_inter"] == 0, row
    assert row["comm_elements_measured_intra"] == pytest.approx(row["comm_elements_measured"]), row
    assert row["comm_elements_formula_intra"] == pytest.approx(row["comm_elements_formula"]), row
    assert row["comm_elements_measured_split_by_kind"]["inter"] == {}, row


def test_hpz_row_matches_its_formulas(hierarchical):
    """hpZ: forward all-gather over N (Ψ), backward all-gather over K from the secondary shard (Ψ - resident: the
    root and, by default, the last block stay gathered and keep no secondary slice), reduce-scatter over N (Ψ);
    model states plain stage 3 over N, the secondary shard 4(Ψ - resident)/K (fp32) beside them."""
    rows, proc = hierarchical
    row = rows["zero3-hpz"]
    assert row["status"] == "ok", row.get("error", row["status"])
    assert row["engine_topology"] == {"option": "hpz", "group_size": H_K, "num_hosts": 1}, row
    psi, resident, n_tensors = _counts()
    pad = n_tensors * (H_WORLD - 1)  # per pass: each flat group pads fewer than N elements (the slices split that)
    formula = psi + (psi - resident) + psi
    assert row["comm_elements_formula"] == formula, row
    assert row["comm_elements_formula_by_kind"] == {"all_gather": 2 * psi - resident, "reduce_scatter": psi}, row
    _within(row["comm_elements_measured"], formula, formula + 3 * pad, "hpZ elements per step")
    _assert_one_host(row)
    _within(row["state_bytes_measured"] - 16 * psi / H_WORLD, 0, 16 * pad + 8 * n_tensors, "hpZ model states")
    secondary = 4 * (psi - resident) / H_K
    assert row["hpz_secondary_formula_bytes"] == secondary, row
    _within(row["hpz_secondary_peak_bytes"], secondary, secondary + 4 * pad / H_K, "hpZ secondary shard bytes")
    assert "zero3-hpz" in proc.stdout


def test_hsdp_row_matches_its_formulas(hierarchical):
    """Stage 2 HSDP over groups of K: reduce-scatter and all-gather of Ψ inside the group, the all-reduce of the
    Ψ/K gradient shard across the N/K replicas (2Ψ/K); model states stage 2 over K: 4Ψ + 12Ψ/K (fp32)."""
    rows, proc = hierarchical
    row = rows["zero2-hsdp"]
    assert row["status"] == "ok", row.get("error", row["status"])
    assert row["engine_topology"] == {"option": "hsdp", "group_size": H_K, "num_hosts": 1}, row
    psi, _, n_tensors = _counts()
    pad = n_tensors * (H_K - 1)  # groups are padded to a multiple of K
    kinds = {"reduce_scatter": psi, "all_gather": psi, "all_reduce": 2 * psi / H_K}
    assert row["comm_elements_formula_by_kind"] == pytest.approx(kinds), row
    formula = sum(kinds.values())
    _within(row["comm_elements_measured"], formula, formula + (2 + 2 / H_K) * pad, "HSDP elements per step")
    assert set(row["comm_elements_measured_by_kind"]) == set(kinds), row
    _assert_one_host(row)
    state = 4 * psi + 12 * psi / H_K
    assert row["state_bytes_formula"] == pytest.approx(state), row
    _within(row["state_bytes_measured"] - state, 0, 16 * pad + 8 * n_tensors, "HSDP model states")
    assert row["hpz_secondary_peak_bytes"] == 0, row
    assert "zero2-hsdp" in proc.stdout


def test_bad_ranks_per_host_skips_the_rows_with_the_reason(tmp_path):
    """K = 3 does not divide 4 ranks: both rows are skipped, naming the flag and the K that would do, no worker is
    started and the command succeeds."""
    out = tmp_path / "out.json"
    proc = _run_bench(["--systems", "zero3-hpz,zero2-hsdp", "--ranks-per-host", "3", "--json", str(out)],
                      world=H_WORLD, timeout=300)
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = _read_json(out)["rows"]
    assert [r["system"] for r in rows] == ["zero3-hpz", "zero2-hsdp"]
    for row in rows:
        assert row["status"] == "skipped", row
        assert row["reason"] == "--ranks-per-host 3 does not divide N=4 ranks; give --ranks-per-host K, one of 2", row
    assert proc.stdout.count("skipped: --ranks-per-host 3 does not divide") == 2, proc.stdout
    assert "zero3-hpz ..." not in proc.stderr, "no worker group for a skipped row"


@pytest.mark.parametrize("n, k, reason", [
    (2, None, "N=2 (--num-processes) has no such K"),  # no default: nothing between 1 and N divides 2
    (9, None, "the default N//2 needs an even N"),
    (4, 4, "is the plain stage"),
    (4, 1, "is the plain stage"),
])
def test_ranks_per_host_reasons(n, k, reason):
    from hf_zero.tools.bench.runner import resolve_group_size

    got, why = resolve_group_size(n, k)
    assert got is None and reason in why and "--ranks-per-host" in why, why
    assert resolve_group_size(4, None) == (2, None) and resolve_group_size(8, 4) == (4, None)


def test_compile_rows_train_like_the_eager_ones(tmp_path):
    """--compile adds a '<system>+compile' row beside each system: the same training compiled after sharding
    (aot_eager: dynamo and autograd tracing without inductor's C++ build), so its last loss equals the eager row's,
    and at stage 3 each transformer block's gather hook is a graph break (the hooks run outside compiled code)."""
    out = tmp_path / "compile.json"
    proc = _run_bench(["--systems", "zero3", "--compile", "aot_eager", "--json", str(out)])
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = {r["system"]: r for r in _read_json(out)["rows"]}
    assert list(rows) == ["zero3", "zero3+compile"]
    eager, compiled = rows["zero3"], rows["zero3+compile"]
    assert eager["status"] == compiled["status"] == "ok", (eager, compiled)
    assert compiled["loss_last_step"] == pytest.approx(eager["loss_last_step"], rel=1e-5)
    assert compiled["compile_backend"] == "aot_eager" and "graph_breaks" not in eager
    hook_breaks = sum(n for reason, n in rows["zero3+compile"]["graph_break_reasons"].items()
                      if "torch.compiler.disable" in reason and "pre_forward" in reason)
    assert hook_breaks >= 2, rows["zero3+compile"]["graph_break_reasons"]  # the tiny preset's 2 blocks at least
    assert "zero3+compile:" in proc.stdout and "graph breaks" in proc.stdout


def test_collectives_systems_are_each_stage_chunked_and_flat_side_by_side():
    """`--systems collectives`: hf_zero's stages 1-3 with ZeroConfig.collectives forced to "chunked" and "flat",
    each stage's two rows next to each other; not in `all`."""
    from hf_zero.tools.bench.cli import _parse_systems
    from hf_zero.tools.bench.runner import SYSTEMS

    names = _parse_systems("ddp,collectives")
    assert names == ["ddp"] + [f"zero{k}-{form}" for k in (1, 2, 3) for form in ("chunked", "flat")]
    assert [SYSTEMS[n].collectives for n in names[1:]] == ["chunked", "flat"] * 3
    assert not set(names[1:]) & set(_parse_systems("all"))


def test_profile_writes_a_trace_per_rank_and_each_systems_phases(tmp_path):
    """--profile DIR: a Chrome trace per system and rank holding hf_zero's ranges, and per system the milliseconds
    per step in each phase: stage 1 reduces and all-gathers after its step, stage 3 gathers and releases and has no
    all-gather after the step, DDP has no hf_zero phase; the phases of one step fit inside that step's time."""
    out, traces = tmp_path / "profile.json", tmp_path / "traces"
    proc = _run_bench(["--systems", "ddp,zero1,zero3", "--profile", str(traces), "--json", str(out)])
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = {r["system"]: r for r in _read_json(out)["rows"]}
    assert sorted(os.listdir(traces)) == sorted(f"{s}-rank{r}.json" for s in rows for r in range(WORLD))
    with open(traces / "zero3-rank1.json") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"hf_zero.gather", "hf_zero.release", "hf_zero.reduce", "hf_zero.step"} <= names
    assert rows["ddp"]["phases_ms_per_step"] == {}
    zero1, zero3 = rows["zero1"]["phases_ms_per_step"], rows["zero3"]["phases_ms_per_step"]
    assert {"hf_zero.reduce", "hf_zero.step", "hf_zero.step.update", "hf_zero.step.all_gather"} <= set(zero1)
    assert "hf_zero.gather" not in zero1 and {"hf_zero.gather", "hf_zero.release"} <= set(zero3)
    for row in (rows["zero1"], rows["zero3"]):
        phases = row["phases_ms_per_step"]
        assert 0 < phases["hf_zero.step.update"] <= phases["hf_zero.step"] < row["step_ms"], row
        outermost = sum(ms for name, ms in phases.items() if name.count(".") == 1)  # step, reduce, gather, ...
        assert outermost < row["step_ms"], row
    assert "zero3: ms/step" in proc.stdout and "hf_zero.gather" in proc.stdout
