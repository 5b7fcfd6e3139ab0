"""`python -m benchmarks.two_hosts --link-rate R` (from a checkout; formerly `hf-zero bench --hosts 2`): the
systems' ranks in two namespace hosts over a rate-limited link.

- the link (benchmarks/hosts.py, re-exported by tests/_hosts.py): tc's rate strings parse, and a timed bulk
  TCP transfer between the hosts runs within 20% of the rate set (and near it again after `set_link_rate`);
- the command line: --hosts other than 2, an odd world, a --ranks-per-host that is not the hosts', a bad rate,
  --lockstep and --load are errors before anything runs; where namespaces cannot be made, the bench says why and
  exits 2; `hf-zero bench --hosts` / `--link-rate` exit 2 naming `python -m benchmarks.two_hosts`;
- the bench on the tiny preset, 2 ranks per host: rows say the link and 2 hosts of 2, and the ledger books what the
  formulas say, counted here from the preset's shapes (r: the resident elements, the root unit and the last block,
  which stage 3 keeps gathered from forward into backward by default, reshard_after_forward="auto" as torchtitan
  does): plain stage 3 sends everything between the hosts, 4 (3Ψ - r) bytes; hpZ books its backward all-gathers
  inside the host, 4 (Ψ - r), and the rest between them;
  hpZ + qwZ (int8) + qgZ (int4) sends codes and fp32 scales (qgZ in two hops: inside the host, then the host's
  sums across), under 0.3x of plain stage 3's bytes between the hosts.

Benchmarks are not timed tests: no steps/s is asserted. Tests that need namespaces carry the `needs_root` marker
and skip with a reason that starts with "needs root" and names what is missing (not root, no `ip` / `tc` /
`unshare`), as tests/test_multihost.py's do.
"""
import json
import math
import os
import subprocess
import sys

import pytest

from _hosts import ROOT, TwoHosts, parse_rate, two_hosts_or_skip

LINK = "200mbit"
WORLD = 4  # 2 ranks per host: hpZ's host groups are the hosts
BLOCK = 256  # ZeroConfig.quantization_block_size's default


def _hosts(**kwargs) -> TwoHosts:
    return two_hosts_or_skip(**kwargs)


def _bench(args, timeout=900):
    cmd = [sys.executable, "-m", "benchmarks.two_hosts", "--preset", "tiny", "--steps", "2", "--warmup", "1",
           "--num-processes", str(WORLD)] + list(args)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------------ the link
@pytest.mark.parametrize("text, bps", [("100mbit", 1e8), ("1gbit", 1e9), ("2.5kbit", 2500), ("10mbps", 8e7),
                                       ("1mibit", 2**20), ("5e6", 5e6), (200, 200)])
def test_rates_parse_as_tc_writes_them(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["fast", "100 furlongs", "-5mbit", "0bit", ""])
def test_bad_rates_are_errors(text):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


@pytest.mark.needs_root
def test_the_link_runs_at_the_rate_set():
    """A bulk TCP transfer from host B to host A, timed at the receiver, within 20% of the rate (tbf counts the
    headers too, so TCP's payload gets ~95% of it); a new rate holds too, and removing it lifts the limit."""
    with _hosts(link_rate=LINK) as hosts:
        assert hosts.link_rate == LINK and hosts.link_rate_bps == 2e8
        assert all("tbf" in q and "200Mbit" in q for q in hosts.link_qdiscs()), hosts.link_qdiscs()
        measured = hosts.measure_link(int(2e8 / 8 * 1.5))  # ~1.5 s of it
        assert 0.8 * 2e8 <= measured <= 1.2 * 2e8, f"{measured / 1e6:.1f} Mbit/s on a {LINK} link"
        hosts.set_link_rate("50mbit")
        measured = hosts.measure_link(int(5e7 / 8 * 1.5))
        assert 0.8 * 5e7 <= measured <= 1.2 * 5e7, f"{measured / 1e6:.1f} Mbit/s on a 50mbit link"
        hosts.set_link_rate(None)
        assert hosts.link_rate is None and not any("tbf" in q for q in hosts.link_qdiscs())
        assert hosts.measure_link(int(2e7)) > 2 * 2e8  # veth unlimited: memory copies


# ------------------------------------------------------------------------------------------------ command line
@pytest.mark.parametrize("args, message", [
    (["--hosts", "3"], "--hosts takes 2"),
    (["--hosts", "1"], "--hosts takes 2"),
    (["--hosts", "2", "--num-processes", "3"], "--num-processes must be even"),
    (["--ranks-per-host", "1"], "K is the ranks per host, 2"),
    (["--hosts", "2", "--link-rate", "100mbit,fast"], "link rate 'fast'"),
    (["--lockstep"], "--lockstep runs every system in one process group here: not with --hosts"),
    (["--load"], "--load runs on this one host"),
])
def test_bad_host_arguments_are_errors_before_any_run(args, message, capsys):
    from benchmarks.two_hosts import main

    argv = ["--preset", "tiny", "--steps", "2", "--warmup", "1", "--num-processes", str(WORLD)] + args
    try:  # in this process: the checks run before anything is spawned (a run would fail the return code)
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err, err
    assert "[1/" not in err, "no system may start"


def test_without_namespaces_the_bench_says_why(monkeypatch, capsys):
    """Where namespaces cannot be made (here: pretended, as for a user who is not root) the run stops with the
    reason and exit code 2, before any system runs."""
    import argparse

    from benchmarks import hosts as hosts_module
    from benchmarks import two_hosts

    monkeypatch.setattr(hosts_module.TwoHosts, "_unavailable",
                        staticmethod(lambda need_tc=False: "making network namespaces needs root"))
    parser = argparse.ArgumentParser()
    two_hosts.add_host_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--systems", "zero3", "--num-processes", "4", "--hosts", "2",
                              "--link-rate", "100mbit"])
    assert two_hosts.run(args) == 2
    err = capsys.readouterr().err
    assert "--hosts 2 runs the ranks in two hosts made of Linux network namespaces" in err, err
    assert "making network namespaces needs root" in err, err
    assert "[1/1]" not in err


@pytest.mark.parametrize("args, flags", [(["--hosts", "2"], ["--hosts"]), (["--hosts=1"], ["--hosts"]),
                                         (["--hosts", "2", "--link-rate", "100mbit"], ["--hosts", "--link-rate"]),
                                         (["--link-rate", "1gbit", "--an-unknown-flag"], ["--link-rate"])])
def test_hf_zero_bench_names_the_two_host_command(args, flags, capsys):
    """The two-host bench moved out of the library (it needs root): `hf-zero bench --hosts` / `--link-rate` exit 2
    with a message naming `python -m benchmarks.two_hosts`, before argparse and before anything runs; so does
    `run` on parsed arguments that hold them."""
    import argparse

    from hf_zero.cli import main
    from hf_zero.tools.bench import cli

    assert main(["bench", "--preset", "tiny", *args]) == 2
    err = capsys.readouterr().err
    for flag in flags:
        assert f"hf-zero bench: error: {flag} moved out of the library" in err, err
    assert "`python -m benchmarks.two_hosts`" in err and "benchmarks/README.md" in err and "[1/" not in err, err
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["--preset", "tiny", "--hosts", "2"])) == 2
    assert "python -m benchmarks.two_hosts" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the bench
def _counts():
    """Ψ of the tiny preset (written out: 2 layers, width 64, vocabulary 512, 128 positions; wte tied to lm_head)
    and its resident elements under the default reshard_after_forward ("auto"): the root unit (everything outside
    the blocks) and the last block, counted from the shapes."""
    d, v, p, layers = 64, 512, 128, 2
    block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    root = v * d + p * d + 2 * d
    return layers * block + root, root + block


def _exact_elements():
    """qgZ keeps 1-D parameters out of the quantized reduce-scatter (engine/routes.py, keeps_exact): the tiny
    preset's LayerNorms and biases (per block: ln_1, ln_2 2d each, c_attn's bias 3d, the projections' d each, c_fc's
    4d; ln_f 2d). No matrix of it is smaller than a block."""
    d, layers = 64, 2
    return layers * (2 * d + 2 * d + 3 * d + d + 4 * d + d) + 2 * d


def _qbytes(elements, world, bits):
    chunk = math.ceil(elements / world)
    return world * ((chunk if bits == 8 else (chunk + 1) // 2) + 4 * math.ceil(chunk / BLOCK))


@pytest.mark.slow
@pytest.mark.needs_root
def test_bench_across_two_hosts_books_the_formula(tmp_path):
    """zero3, zero3-hpz and zero3-hpz-qwz-qgz on 2 hosts of 2 ranks over a 200mbit link, run as a user runs it
    (`python -m benchmarks.two_hosts` from the checkout's root)."""
    _hosts(link_rate=LINK).close()  # skip here, with the reason, where namespaces or tc cannot be had
    out = tmp_path / "rows.json"
    proc = _bench(["--systems", "zero3,zero3-hpz,zero3-hpz-qwz-qgz", "--hosts", "2", "--link-rate", LINK,
                   "--json", str(out)])
    assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    with open(out) as f:
        payload = json.loads(f.read())
    rows = {r["system"]: r for r in payload["rows"]}
    assert set(rows) == {"zero3", "zero3-hpz", "zero3-hpz-qwz-qgz"}, rows
    (link,) = payload["settings"]["links"]
    assert link["rate"] == LINK and 0.8 * 2e8 <= link["measured_bps"] <= 1.2 * 2e8, link
    assert payload["settings"]["threads_per_rank"] == 1 and payload["settings"]["hosts"] == 2
    psi, resident = _counts()
    for name, r in rows.items():
        assert r["status"] == "ok", r
        assert r["link_rate"] == LINK and r["num_hosts"] == 2 and r["host_size"] == 2, r
        assert r["engine_topology"]["num_hosts"] == 2, r
        assert r["steps_per_s"] > 0, r
    for line in (LINK, "zero3-hpz-qwz-qgz", "inter-host MB/step (formula)"):
        assert line in proc.stdout, proc.stdout

    plain = rows["zero3"]  # everything over the world group, which spans the hosts
    assert plain["comm_bytes_measured_inter"] == plain["comm_bytes_formula_inter"] == 4 * (3 * psi - resident), plain
    assert plain["comm_bytes_measured_intra"] == plain["comm_bytes_formula_intra"] == 0, plain
    assert plain["comm_elements_measured_inter"] == 3 * psi - resident, plain

    hpz = rows["zero3-hpz"]  # the backward's all-gathers inside the host, the rest between the hosts
    assert hpz["comm_bytes_measured_split_by_kind"]["intra"] == {"all_gather": 4 * (psi - resident)}, hpz
    assert hpz["comm_bytes_measured_split_by_kind"]["inter"] == {"all_gather": 4 * psi, "reduce_scatter": 4 * psi}
    assert hpz["comm_bytes_formula_intra"] == 4 * (psi - resident) and hpz["comm_bytes_formula_inter"] == 8 * psi, hpz

    zpp = rows["zero3-hpz-qwz-qgz"]  # int8 weights between the hosts (the host's backward copy exact); int4
    # gradients in qgZ's two hops: Ψ reduce-scattered inside the host, then the host's Ψ/K sums across the hosts
    assert zpp["zero_options"] == {"quantized_weights": "int8", "quantized_gradients": "int4"}, zpp
    assert "quantized-int8" in zpp["strategies_booked"] and "quantized-int4" in zpp["strategies_booked"], zpp
    k, hosts = WORLD // 2, 2
    elements = zpp["comm_elements_measured_split_by_kind"]
    assert elements["intra"] == {"all_gather": psi - resident, "reduce_scatter": psi}, elements
    # the exact slots' all-reduce over the world group (which spans the hosts): 2E in the paper's counting
    exact = _exact_elements()
    assert elements["inter"] == {"all_gather": psi, "reduce_scatter": psi / k, "all_reduce": 2 * exact}, elements
    booked = zpp["comm_bytes_measured_split_by_kind"]
    assert booked["inter"]["all_reduce"] == 4 * 2 * exact, booked
    # the formula quantizes the step's total; the engine each unit's: a partial block (one scale) more per rank
    # and collective at most
    slack = 4 * WORLD * 8
    assert booked["intra"]["all_gather"] == 4 * (psi - resident), booked
    assert 0 <= booked["inter"]["all_gather"] - _qbytes(psi, WORLD, 8) <= slack, booked
    assert 0 <= booked["intra"]["reduce_scatter"] - _qbytes(psi, k, 4) <= slack, booked
    hop2 = hosts * _qbytes(psi, WORLD, 4) // WORLD  # the H ranks of one local index: H x quantized_nbytes(Ψ/N)
    assert 0 <= booked["inter"]["reduce_scatter"] - hop2 <= slack, booked
    # the formula (tools/bench/formulas.py) leaves the exact slots' all-reduce out: 8E bytes across the hosts
    for where, unformulated in (("intra", 0), ("inter", 4 * 2 * exact)):
        assert abs(zpp[f"comm_bytes_measured_{where}"] - unformulated - zpp[f"comm_bytes_formula_{where}"]) \
            <= 2 * slack, zpp
    assert zpp["comm_bytes_measured_inter"] <= 0.3 * plain["comm_bytes_measured_inter"], (zpp, plain)

    # what crossed the link (the veth ends' counters, both directions): the ledger's per-rank count is not that,
    # but the link carries at least one copy of each host's half of every inter-host collective, and hpZ + qwZ +
    # qgZ cuts it as much as the ledger says
    for r in rows.values():
        assert len(r["link_bytes_per_step_by_host"]) == 2 and r["link_bytes_per_step"] > 0, r
    assert plain["link_bytes_per_step"] >= plain["comm_bytes_measured_inter"], plain
    assert zpp["link_bytes_per_step"] <= 0.3 * plain["link_bytes_per_step"], (zpp, plain)
