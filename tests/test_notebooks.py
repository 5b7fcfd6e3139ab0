"""The notebooks under notebooks/ run top to bottom and agree with the paper's formulas.

Each notebook is executed once per test session with nbclient on a ``python3`` kernel that runs this interpreter,
with the small CI parameters below (environment variables its first cell reads). A cell that raises fails the
notebook's tests; so does a plot that is not both displayed (an image/png output) and saved (a PNG file). The
numbers each notebook writes to ``summary.json`` are then checked against independent references: the paper's
model-state formulas (hf_zero.tools.estimate.formulas), its 2Ψ / 3Ψ communication counts and the activation formula of Korthikanti
et al. 2022. Needs the ``notebook`` extra (matplotlib, nbclient, nbformat, ipykernel); skipped without it, except
under HF_ZERO_REQUIRE_EXTRAS_TESTS=1 (CI), where that skip fails (`needs_extras`).
"""
import json
import math
import os
import sys
import time
from unittest import mock

import pytest

from hf_zero.tools.estimate.activations import paper_layer_bytes
from hf_zero.tools.estimate.formulas import comm_elements_per_step, model_state_bytes, recipe
from hf_zero.tools.notebook import is_png

pytestmark = pytest.mark.needs_extras

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
CELL_TIMEOUT_S = 600
CI_ENV = {  # small runs: about 25 s and 12 s on 2 CPU cores
    "HF_ZERO_NB_MAX_PROCS": "4", "HF_ZERO_NB_STEPS": "2", "HF_ZERO_NB_MAX_LOG2_N": "10",
}
PLOTS = {
    "zero_stages_small_cluster": ("memory_per_rank.png", "communication_per_step.png", "throughput_vs_stage0.png"),
    "plan_a_run": ("memory_per_device.png", "activations_per_device.png", "hosts_memory_vs_traffic.png"),
}
REL = 1e-3  # measured model states and traffic vs the formulas: padding and Adam's 4-byte step counters only


def _path(name):
    return os.path.join(NOTEBOOKS, name + ".ipynb")


# ------------------------------------------------------------------------------------------------ committed files
@pytest.mark.parametrize("name", sorted(PLOTS))
def test_committed_notebook_is_clean(name):
    """Outputs and execution counts are never committed; the first code cell holds the CI parameters."""
    with open(_path(name)) as f:
        nb = json.load(f)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for i, cell in enumerate(code):
        assert cell["outputs"] == [] and cell["execution_count"] is None, f"{name}: code cell {i} has outputs"
    assert "HF_ZERO_NB_" in "".join(code[0]["source"]), f"{name}: the first code cell must read the parameters"
    assert nb["metadata"]["kernelspec"]["name"] == "python3"


# ------------------------------------------------------------------------------------------------ execution
def _kernel_name():
    """The python3 kernel, provided it runs this interpreter (jupyter_client maps a spec's bare "python" to
    sys.executable, and falls back to ipykernel's own spec when none is installed)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.fail("no python3 kernel spec: pip install ipykernel (or python -m ipykernel install --sys-prefix)")
    exe = spec.argv[0]
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    if exe not in bare and os.path.realpath(exe) != os.path.realpath(sys.executable):
        pytest.fail(f"the python3 kernel runs {exe}, not {sys.executable}: python -m ipykernel install --sys-prefix")
    return "python3"


def _execute(name, out_dir):
    for dep in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        pytest.importorskip(dep, reason="pip install -e '.[notebook]'")
    import nbclient
    import nbformat

    nb = nbformat.read(_path(name), as_version=4)
    env = dict(CI_ENV, HF_ZERO_NB_OUT=str(out_dir),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    start = time.perf_counter()
    with mock.patch.dict(os.environ, env):  # the kernel (and the ranks it forks) inherit these
        nbclient.NotebookClient(nb, kernel_name=_kernel_name(), timeout=CELL_TIMEOUT_S,
                                resources={"metadata": {"path": NOTEBOOKS}}).execute()
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    return {"nb": nb, "out": str(out_dir), "summary": summary, "seconds": time.perf_counter() - start}


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    return _execute("zero_stages_small_cluster", tmp_path_factory.mktemp("nb_cluster"))


@pytest.fixture(scope="module")
def plan_run(tmp_path_factory):
    return _execute("plan_a_run", tmp_path_factory.mktemp("nb_plan"))


def _check_plots(run, name):
    images = [o for c in run["nb"].cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == len(PLOTS[name]), f"{name}: {len(images)} plots displayed"
    for plot in PLOTS[name]:
        assert is_png(os.path.join(run["out"], plot)), f"{name}: {plot} missing or not a PNG"


# ------------------------------------------------------------------------------------------------ small cluster
@pytest.mark.slow
def test_small_cluster_notebook_plots(cluster_run):
    _check_plots(cluster_run, "zero_stages_small_cluster")


@pytest.mark.slow
def test_small_cluster_ranks_are_separate_processes(cluster_run):
    s = cluster_run["summary"]
    assert s["world_sizes"] == list(range(1, int(CI_ENV["HF_ZERO_NB_MAX_PROCS"]) + 1))
    for key, reps in s["runs"].items():
        stage, n = map(int, key.split(","))
        assert [r["rank"] for r in reps] == list(range(n)) and {r["world_size"] for r in reps} == {n}, key
        assert len({r["pid"] for r in reps}) == n, f"{key}: ranks share a process"
        assert all(r["tokens_per_s"] > 0 and math.isfinite(r["loss"]) for r in reps), key


@pytest.mark.slow
def test_small_cluster_memory_matches_paper_formula(cluster_run):
    s = cluster_run["summary"]
    r = recipe(s["mixed_precision"], "fp32")
    for key, reps in s["runs"].items():
        stage, n = map(int, key.split(","))
        want = model_state_bytes(s["psi"], n, stage, r)
        for rep in reps:
            got = rep["memory"]["model_states"]
            assert abs(got - want) <= REL * want, f"stage {stage} N={n} rank {rep['rank']}: {got} vs {want}"


@pytest.mark.slow
def test_small_cluster_communication_is_2psi_and_3psi(cluster_run):
    """Paper counting: 2Ψ per rank per step at stages 0-2; 3Ψ at stage 3, less what hf_zero keeps gathered from
    forward to backward (gathered once, not twice): its root unit and, by default (reshard_after_forward="auto", as
    torchtitan does), the last block. The notebook counts them from the parameter names."""
    s = cluster_run["summary"]
    psi, resident = s["psi"], s["resident_params"]
    for key, reps in s["runs"].items():
        stage, n = map(int, key.split(","))
        if n == 1:
            continue
        for rep in reps:
            per_step = {k: v["elements"] / rep["steps"] for k, v in rep["comm"].items()}
            want = comm_elements_per_step(psi, stage, resident=resident if stage == 3 else 0)
            for kind, elements in want.items():
                assert abs(per_step[kind] - elements) <= REL * elements, (key, kind, per_step[kind], elements)
            total = per_step["total"] / psi
            assert (2.5 < total < 3.0) if stage == 3 else abs(total - 2) <= REL * 2, (key, total)


# ------------------------------------------------------------------------------------------------ plan a run
def test_plan_notebook_plots(plan_run):
    _check_plots(plan_run, "plan_a_run")


def test_plan_notebook_model_states_match_paper_formula(plan_run):
    s = plan_run["summary"]
    r = recipe(s["mixed_precision"], "fp32")
    for name, plan in s["plans"].items():
        for stage, per_n in plan["model_states"].items():
            for n, got in zip(s["world_sizes"], per_n):
                want = model_state_bytes(plan["psi"], n, int(stage), r)
                assert abs(got - want) <= 0.01 * want, f"{name} stage {stage} N={n}: {got} vs {want}"


def test_plan_notebook_activations_match_paper_formula(plan_run):
    """Checkpointing keeps 2·s·b·h bytes per layer (the paper's count in 16-bit). GPT-2 small without checkpointing
    is the paper's own layer (dropout on, 4h MLP, LayerNorm) with two differences the formula spells out: GPT-2's
    unfused gelu_new keeps 3 more s·b·4h tensors, and the LayerNorm statistics (2 x 8 bytes per token)."""
    s = plan_run["summary"]
    assert s["mixed_precision"] == "bf16"
    for name, plan in s["plans"].items():
        act, shape = plan["activations"], plan["activations"]["shape"]
        t, h = s["batch"] * plan["seq_len"], shape["hidden"]
        assert act["checkpointing"]["layers"] == shape["layers"] * 2 * t * h, name
        assert act["checkpointing"]["peak"] < act["no_checkpointing"]["peak"], name
    gpt2 = s["plans"]["GPT-2 124M"]
    seq, h, heads = gpt2["seq_len"], 768, 12
    extra = 2 * 3 * s["batch"] * seq * 4 * h + 2 * 8 * s["batch"] * seq
    assert gpt2["activations"]["no_checkpointing"]["per_layer"] == paper_layer_bytes(seq, s["batch"], h, heads) + extra


def test_plan_notebook_fits_include_activations(plan_run):
    for name, plan in plan_run["summary"]["plans"].items():
        for mode, mins in plan["fits_with_activations"].items():
            for stage, n in mins.items():
                base = plan["fits"][stage]
                assert n is None or (base is not None and n >= base), (name, mode, stage)


def test_plan_notebook_hosts_match_paper_formulas(plan_run):
    """N ranks in hosts of K: HSDP is the stage's formula with N replaced by K and sends only the 2Ψ/K all-reduce of
    the gradient shard across hosts; hpZ sends 2Ψ across hosts, keeps the backward all-gather (Ψ less the resident
    units, the root and by default the last block, which stay gathered) inside the host, and holds
    2 bytes x (Ψ - resident) / K of bf16 secondary shard on top of stage 3; plain stage 3 sends 3Ψ - resident across
    hosts and nothing inside."""
    s = plan_run["summary"]
    r = recipe(s["mixed_precision"], "fp32")

    def close(got, want, what, rel=REL):
        assert abs(got - want) <= rel * want, f"{what}: {got} vs {want}"

    for name, plan in s["plans"].items():
        hosts, psi = plan["hosts"], plan["psi"]
        n, k, resident, rows = hosts["world_size"], hosts["ranks_per_host"], hosts["resident_params"], hosts["rows"]
        assert 1 < k < n and set(rows["3"]) == {"none", "hsdp", "hpz"}, name
        for stage in (1, 2, 3):
            hsdp = rows[str(stage)]["hsdp"]
            inside = sum(comm_elements_per_step(psi, stage, resident=resident if stage == 3 else 0).values())
            close(hsdp["model_states"], model_state_bytes(psi, k, stage, r), f"{name} stage {stage} HSDP", 0.01)
            close(hsdp["intra_elements"], inside, f"{name} stage {stage} HSDP intra")
            close(hsdp["inter_elements"], 2 * psi / k, f"{name} stage {stage} HSDP inter")
        plain, hpz = rows["3"]["none"], rows["3"]["hpz"]
        assert plain["intra_elements"] == 0, name
        close(plain["inter_elements"], 3 * psi - resident, f"{name} stage 3 inter")
        close(hpz["inter_elements"], 2 * psi, f"{name} hpZ inter")
        close(hpz["intra_elements"], psi - resident, f"{name} hpZ intra")
        secondary = r.param * (psi - resident) / k
        close(hpz["model_states"], model_state_bytes(psi, n, 3, r) + secondary, f"{name} hpZ", 0.01)
