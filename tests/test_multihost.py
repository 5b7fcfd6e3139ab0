"""hf_zero across two hosts, launched as users launch on a cluster: 2 ranks per host, world size 4, gloo over a
veth pair between two network namespaces (tests/_hosts.py: own hostname, own disk, own address per host).

- `accelerate launch --multi_gpu --num_machines 2 --machine_rank R --main_process_ip A --main_process_port P
  --num_processes 4` on each host (Accelerate passes torchrun a static rendezvous at A:P), and
  `torchrun --nnodes 2 --node_rank R --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint A:P`.
- tests/scripts/multihost_train.py trains stages 1, 2, 3 one after another in one launch (HfZeroAccelerator, or
  ZeroTrainer); the two-host run must equal the same script launched on ONE host at world size 4 (losses, grad
  norms, final weights within 1e-5; the same collective volume per step), every rank must report the hostname of
  the host it ran on, and both launchers must end cleanly: exit code 0, no worker ended by a signal, no
  "terminate called" (a worker aborting at interpreter exit), nothing left running.
- examples/finetune_causal_lm.py --tiny (the main job) across the two hosts equals its single-host world-4 run.

Every wait is bounded. A launcher whose peer host failed would sit in torchrun's exit barrier for 300 s (the
agent's exit_barrier_timeout, not settable from the torchrun/accelerate command line or the environment); the
harness gives the surviving host PEER_GRACE_S after the other one exited, then kills every process of it and
fails the test with both hosts' output. The c10d rendezvous gets `--rdzv-conf join_timeout=60` (default 600 s).
The c10d rendezvous numbers the nodes itself (sorted by hostname; `--node_rank` is ignored there): the harness's
host names sort host A first, so ranks 0-1 land on host A as with the static rendezvous.

What "ends cleanly" rules out is the reported failure: a worker aborting at interpreter exit ("terminate called
without an active exception", SIGABRT), after which the other host waits in torchrun's exit barrier. Its cause:
gloo's worker threads outlive destroy_process_group() (default arguments `group=dist.group.WORLD` of modules
imported after the group was made keep it alive) and run into interpreter finalization, where a worker that drops
the last reference to a Python tensor takes the GIL and CPython ends the thread with pthread_exit, through a
noexcept destructor. It is a race (about 1 launch in 40 here), so these tests catch it now and then rather than
every time: `HF_ZERO_MULTIHOST_REPEAT=N` repeats a two-host stage-3 launch N times (default 1; even
attempts leave the group to HfZeroAccelerator's exit hook, odd ones call end_training()), and
test_gloo_threads_are_gone_before_the_interpreter_finalizes checks the cause itself, deterministically (it failed
until the exit hook freed the destroyed groups: now hf_zero/engine/exit.py, registered by every ZeroEngine and
HfZeroAccelerator).
Not a failure: torchrun's own exit-barrier race (pytorch/pytorch#69520), logged by an agent that then exits 0.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys

import pytest
import torch
from safetensors.torch import load_file

from _hosts import ROOT, TwoHosts, base_env, run_local, two_hosts_or_skip

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "multihost_train.py")
FINETUNE = os.path.join(ROOT, "examples", "finetune_causal_lm.py")
BIN = os.path.dirname(sys.executable)
ACCELERATE_LAUNCH = ([os.path.join(BIN, "accelerate"), "launch"] if os.path.isfile(os.path.join(BIN, "accelerate"))
                     else [sys.executable, "-m", "accelerate.commands.launch"])
TORCHRUN = ([os.path.join(BIN, "torchrun")] if os.path.isfile(os.path.join(BIN, "torchrun"))
            else [sys.executable, "-m", "torch.distributed.run"])
RUN_TIMEOUT_S = 240  # one launch, both hosts (a healthy one takes 20-40 s on 2 cores)
PEER_GRACE_S = 30  # once one host's launcher has exited, the other must follow within this
STAGES = [{"stage": 1}, {"stage": 2}, {"stage": 3}]
ATTEMPTS = list(range(max(1, int(os.environ.get("HF_ZERO_MULTIHOST_REPEAT", "1")))))  # the race: repeat for more
FINETUNE_STEPS = 4


# ------------------------------------------------------------------------------------------------ launching
@pytest.fixture
def two_hosts():
    hosts = two_hosts_or_skip()  # skips with "needs root, ..." and what is missing
    with hosts:
        yield hosts


def accelerate_on_two_hosts(hosts: TwoHosts, script_and_args):
    port = hosts.free_port(0)
    return [ACCELERATE_LAUNCH + ["--multi_gpu", "--num_machines", "2", "--machine_rank", str(rank),
                                 "--main_process_ip", hosts.addr(0), "--main_process_port", str(port),
                                 "--num_processes", "4", "--mixed_precision", "no", "--dynamo_backend", "no",
                                 *script_and_args] for rank in range(2)]


def torchrun_on_two_hosts(hosts: TwoHosts, script_and_args):
    port = hosts.free_port(0)
    # join_timeout bounds the rendezvous (default 600 s) should the other host never arrive
    return [TORCHRUN + ["--nnodes", "2", "--node_rank", str(rank), "--nproc-per-node", "2",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addr(0)}:{port}",
                        "--rdzv-conf", "join_timeout=60", *script_and_args] for rank in range(2)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_on_one_host(tmp, script_and_args):
    """The same script on this machine, outside any namespace: one host, 4 ranks."""
    env = base_env({k: os.path.join(tmp, v) for k, v in
                    (("HOME", "home"), ("HF_HOME", "hf_home"), ("HF_ZERO_CACHE", "cache"), ("TMPDIR", "tmp"))})
    for key in ("HOME", "HF_HOME", "HF_ZERO_CACHE", "TMPDIR"):
        os.makedirs(env[key], exist_ok=True)
    cmd = ACCELERATE_LAUNCH + ["--multi_gpu", "--num_processes", "4", "--num_machines", "1", "--mixed_precision",
                               "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
                               *script_and_args]
    run = run_local(cmd, env, timeout=RUN_TIMEOUT_S, cwd=tmp)
    assert_clean_exit([run])
    return run


# torchrun's exit barrier on a host whose store lives on the other host: when the store's host leaves the barrier
# first and exits, the waiting agent's last `store.wait` sees the connection close. The agent logs the traceback and
# exits 0 right away (pytorch/pytorch#69520, open). Not a failure of the run: these log lines are left out of the
# output scan below (every worker has already exited 0 by then), and the run is marked.
_AGENT_LOG = re.compile(r"^[EWI]\d{4} [\d:.]+ (\d+) \S*torch/distributed/elastic/agent/server/api\.py:\d+\] ")


def exit_barrier_race(out):
    """(output without the agent's exit-barrier error lines, whether they were there)."""
    lines = out.splitlines()
    hit = [_AGENT_LOG.match(line) for line in lines if "Error waiting on exit barrier" in line]
    if not hit or not hit[0] or "Connection was likely closed" not in out:
        return out, False
    prefix = hit[0].group(0)
    return "\n".join(line for line in lines if not line.startswith(prefix)), True


def assert_clean_exit(runs):
    """Exit code 0 on every host, no worker ended by a signal, no abort at exit, nothing left running."""
    problems = []
    for r in runs:
        out, r.exit_barrier_race = exit_barrier_race(r.output)
        if r.killed:
            problems.append(f"{r.name}: killed by the harness: {r.killed}")
        elif r.returncode != 0:
            sig = f" ({signal.Signals(-r.returncode).name})" if r.returncode < 0 else ""
            problems.append(f"{r.name}: launcher exit code {r.returncode}{sig}")
        if r.leftover:
            problems.append(f"{r.name}: processes {r.leftover} still running after the launcher exited")
        for needle in ("terminate called", "Fatal Python error", "core dumped", "Traceback (most recent call last)"):
            if needle in out:
                problems.append(f"{r.name}: {needle!r} in the output")
        # torchrun's failure report: a worker's exit code, negative when a signal ended it
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
        if codes:
            problems.append(f"{r.name}: torchrun reports worker exit codes {codes}")
        signals = re.findall(r"Signal \d+ \(SIG\w+\) received", out)
        if signals:
            problems.append(f"{r.name}: {signals}")
    assert not problems, "\n".join(problems) + "\n" + "\n".join(r.describe() for r in runs)


# ------------------------------------------------------------------------------------------------ comparing
def load_results(out_dir):
    with open(os.path.join(out_dir, "results.json")) as f:
        results = json.load(f)
    for entry in results:
        entry["state"] = load_file(os.path.join(out_dir, entry["weights"]))
    return results


def assert_same_training(ours, ref, rtol=1e-5):
    assert ours["config"] == ref["config"]
    what = f"config {ours['config']}"
    assert ours["world_size"] == ref["world_size"] == 4, what
    assert len(ours["losses"]) == len(ref["losses"]) > 0 and len(ours["norms"]) == len(ref["norms"]) == 3, what
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=1e-6,
                               msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(ref["norms"]), rtol=rtol, atol=1e-6,
                               msg=lambda m: f"{what} grad norms: {m}")
    wa, wb = ours["state"], ref["state"]
    assert set(wa) == set(wb) and wa, (what, set(wa) ^ set(wb))
    for k in wb:
        err = ((wa[k].double() - wb[k].double()).norm() / wb[k].double().norm().clamp_min(1e-30)).item()
        assert err < rtol, f"{what}: {k}: relative error {err:.2e}"
    # the same collectives, whatever the hosts: calls, elements and bytes of the last step per rank
    for a, b in zip(ours["ranks"], ref["ranks"]):
        ta, tb = a["comm_last_step"].get("total", {}), b["comm_last_step"].get("total", {})
        assert ta and {k: ta[k] for k in ("calls", "elements", "bytes")} == \
            {k: tb[k] for k in ("calls", "elements", "bytes")}, (what, a["rank"], ta, tb)


def assert_ranks_on(entry, hostnames):
    """Rank r ran on hostnames[r], as the next local rank of that host (launchers number the ranks host by host)."""
    ranks = sorted(entry["ranks"], key=lambda x: x["rank"])
    assert [x["rank"] for x in ranks] == [0, 1, 2, 3]
    assert [x["hostname"] for x in ranks] == hostnames, ranks
    assert [x["local_rank"] for x in ranks] == [hostnames[:r].count(hostnames[r]) for r in range(4)], ranks
    if len(set(hostnames)) == 2:
        for x in ranks:  # the ledger books every world-spanning collective as inter-host (where it has that column)
            total = x["comm_last_step"].get("total", {})
            if "inter_elements" in total and not entry["config"].get("shard_group_size") \
                    and not entry["config"].get("hpz_partition_size"):
                assert total["inter_elements"] == total["elements"] > 0, (entry["config"], total)


@pytest.fixture(scope="module")
def single_host(tmp_path_factory):
    """The single-host world-4 reference of (api, configs), launched once per module."""
    cache = {}

    def get(api, configs, ending="end_training", with_dir=False):
        key = (api, json.dumps(configs), ending)
        if key not in cache:
            tmp = str(tmp_path_factory.mktemp(f"one_host_{api}"))
            out = os.path.join(tmp, "out")
            accelerate_on_one_host(tmp, [SCRIPT, "--api", api, "--configs", json.dumps(configs), "--out", out,
                                         "--ending", ending, "--exit-report"])
            cache[key] = (load_results(out), out)
            machine = socket.gethostname()
            for entry in cache[key][0]:
                assert_ranks_on(entry, [machine] * 4)
        return cache[key] if with_dir else cache[key][0]

    return get


def train_on_two_hosts(hosts, launcher, api, configs, ending="end_training"):
    out = os.path.join(hosts.disk, "out")
    script = [SCRIPT, "--api", api, "--configs", json.dumps(configs), "--out", out, "--ending", ending, "--exit-report"]
    runs = hosts.run(launcher(hosts, script), timeout=RUN_TIMEOUT_S, peer_grace=PEER_GRACE_S)
    assert_clean_exit(runs)
    # every rank got through all its exit hooks, and wrote so on its own host's disk
    for i, ranks in enumerate(([0, 1], [2, 3])):
        reports = sorted(f for f in os.listdir(os.path.join(hosts.disk_of(i), "out")) if f.startswith("exit_"))
        assert reports == [f"exit_threads_rank{r}.json" for r in ranks], (i, reports)
    assert "MULTIHOST_TRAIN finished" in runs[0].stdout, runs[0].describe()
    # rank 0 (host A) wrote the results on its own disk; host B's disk holds none of them
    assert not os.path.exists(os.path.join(hosts.disk_of(1), "out", "results.json"))
    results = load_results(os.path.join(hosts.disk_of(0), "out"))
    assert [e["config"] for e in results] == configs
    for entry in results:
        assert_ranks_on(entry, [hosts.hostname(0)] * 2 + [hosts.hostname(1)] * 2)
    return runs, results


# ------------------------------------------------------------------------------------------------ the harness
@pytest.mark.needs_root
def test_harness_hosts_have_own_names_disks_and_addresses(two_hosts):
    h = two_hosts
    port = h.free_port(0)
    # host A serves on its veth address; host B writes a file on its disk, then connects to A over the veth
    server = (
        "import json, os, socket\n"
        f"s = socket.create_server(({h.addr(0)!r}, {port}))\n"
        "c, peer = s.accept()\n"
        "c.settimeout(20)\n"
        "msg = c.recv(200).decode()\n"
        "c.sendall(socket.gethostname().encode())\n"
        "print('peer', peer[0], 'says', msg)\n"
        "print('disk', json.dumps(sorted(os.listdir('.'))))\n"  # B has written its file by now
        f"print('real', json.dumps(sorted(os.listdir({h._real!r}))))\n"
        "print('resolves', socket.gethostbyname(msg))\n"
        "print('ifname', os.environ['GLOO_SOCKET_IFNAME'])\n"
        "open('written-by-a', 'w').write('a')\n"
    )
    client = (
        "import json, os, socket, time\n"
        "open('written-by-b', 'w').write('b')\n"
        "deadline = time.monotonic() + 20\n"
        "while True:\n"
        "    try:\n"
        f"        c = socket.create_connection(({h.addr(0)!r}, {port}), timeout=5)\n"
        "        break\n"
        "    except OSError:\n"
        "        if time.monotonic() > deadline:\n"
        "            raise\n"
        "        time.sleep(0.05)\n"  # polling A's listening socket, with a deadline
        "c.settimeout(20)\n"
        "c.sendall(socket.gethostname().encode())\n"
        "print('server', c.recv(200).decode())\n"
        "print('disk', json.dumps(sorted(os.listdir('.'))))\n"
    )
    a, b = h.run([[sys.executable, "-c", server], [sys.executable, "-c", client]], timeout=60, peer_grace=20)
    assert a.returncode == 0 and b.returncode == 0, a.describe() + b.describe()
    lines_a = dict(line.split(" ", 1) for line in a.stdout.splitlines())
    lines_b = dict(line.split(" ", 1) for line in b.stdout.splitlines())
    # own hostnames, each other's, resolvable like cluster hosts; neither is this machine's
    assert lines_a["peer"] == f"{h.addr(1)} says {h.hostname(1)}", a.stdout
    assert lines_b["server"] == h.hostname(0), b.stdout
    assert h.hostname(0) != h.hostname(1) and socket.gethostname() not in (h.hostname(0), h.hostname(1))
    assert lines_a["resolves"] == h.addr(1)
    assert lines_a["ifname"] == h.ifname(0)
    # own disks at one path: A does not see B's file (and vice versa), nor the folder holding the real disks
    files_a, files_b = json.loads(lines_a["disk"]), json.loads(lines_b["disk"])
    assert "written-by-b" not in files_a and "written-by-b" in files_b, (files_a, files_b)
    assert lines_a["real"] == "[]", a.stdout
    assert os.path.isfile(os.path.join(h.disk_of(0), "written-by-a"))
    assert os.path.isfile(os.path.join(h.disk_of(1), "written-by-b"))
    assert not os.path.exists(os.path.join(h.disk_of(0), "written-by-b"))
    assert not os.path.exists(os.path.join(h.disk_of(1), "written-by-a"))
    assert os.listdir(h.disk) == []  # the common path itself is only a mount point
    # a stuck host is killed, and the error carries both hosts' output
    from _hosts import HostsTimeout

    with pytest.raises(HostsTimeout, match="still running 1 s after host B") as info:
        h.run([["sh", "-c", "echo waiting; exec sleep 100"], ["sh", "-c", "echo failing; exit 3"]],
              timeout=60, peer_grace=1)
    assert [r.returncode for r in info.value.runs][1] == 3 and "waiting" in str(info.value)


@pytest.mark.needs_root
def test_harness_teardown_removes_namespaces_and_folders():
    hosts = two_hosts_or_skip()
    names, base = [hosts.netns(0), hosts.netns(1)], hosts._base
    with pytest.raises(ZeroDivisionError):
        with hosts:
            hosts.run([["sleep", "0"], ["sleep", "0"]], timeout=30)
            1 / 0  # a failing test body
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not any(n in listed for n in names), listed
    assert not os.path.exists(base)


# ------------------------------------------------------------------------------------------------ training
@pytest.mark.slow
@pytest.mark.needs_root
def test_accelerate_two_hosts_equal_one_host(two_hosts, single_host):
    ref = single_host("accelerate", STAGES)
    _, results = train_on_two_hosts(two_hosts, accelerate_on_two_hosts, "accelerate", STAGES)
    for ours, theirs in zip(results, ref):
        assert_same_training(ours, theirs)


@pytest.mark.slow
@pytest.mark.needs_root
def test_trainer_two_hosts_equal_one_host(two_hosts, single_host):
    ref = single_host("trainer", STAGES, ending="return")
    # a Trainer script just returns: HfZeroAccelerator's exit hook closes the process group
    _, results = train_on_two_hosts(two_hosts, accelerate_on_two_hosts, "trainer", STAGES, ending="return")
    for ours, theirs in zip(results, ref):
        assert_same_training(ours, theirs)


@pytest.mark.slow
@pytest.mark.needs_root
def test_torchrun_two_hosts_stage3_equals_one_host(two_hosts, single_host):
    ref = single_host("accelerate", STAGES)[2]
    assert ref["config"] == {"stage": 3}
    _, results = train_on_two_hosts(two_hosts, torchrun_on_two_hosts, "accelerate", [{"stage": 3}])
    assert_same_training(results[0], ref)


# The recipe of tests/scripts/multihost_train.py (--api accelerate) in plain PyTorch, never hf_zero
RECIPE = dict(world_size=4, steps=3, grad_accum=2, micro_batch=2, seq=16)


def _recipe_model():
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=2,
                                                        n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                                        attn_pdrop=0.0))
    return model.train()


def _recipe_micro_batches():
    """The global micro-batches: Accelerate hands rank r the loader's batches r, r + W, ..., so global micro-batch i
    is rows [i * W * micro_batch, (i + 1) * W * micro_batch) of the script's data (seed 1)."""
    r = RECIPE
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 101, (r["steps"] * r["grad_accum"] * r["micro_batch"] * r["world_size"], r["seq"]),
                         generator=g)
    return list(data.split(r["micro_batch"] * r["world_size"]))


def plain_training():
    """Per-micro-batch losses of the script's training as one process: the same tiny GPT-2 (seed 0), AdamW groups
    and cosine schedule; each loss the global micro-batch's mean (the script logs the ranks' mean of equal-sized
    means), gradients averaged over the accumulation, clipped to 1.0. Accelerate steps a prepared scheduler once
    per process at each optimizer step (batches not split), so does this."""
    from transformers import get_cosine_schedule_with_warmup

    r = RECIPE
    model = _recipe_model()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, eps=1e-6)
    scheduler = get_cosine_schedule_with_warmup(optimizer, 1, r["steps"])
    losses = []
    for i, x in enumerate(_recipe_micro_batches()):
        loss = model(input_ids=x, labels=x).loss
        (loss / r["grad_accum"]).backward()
        losses.append(loss.item())
        if (i + 1) % r["grad_accum"] == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            for _ in range(r["world_size"]):
                scheduler.step()
            optimizer.zero_grad()
    return losses


@torch.no_grad()
def first_loss_with_quantized_weights(bits, block=256):
    """The first micro-batch's loss computed with the weights qwZ's first all-gather gives every rank: each flat
    group of the initial model (tests/_flat_layout.py, padded to the W = 4 ranks the forward gathers from, hpZ
    or not) cut into the ranks' shards, each quantized and dequantized by test_quantize's plain-PyTorch reference."""
    from test_quantize import ref_round_trip

    from _flat_layout import layout

    model, w = _recipe_model(), RECIPE["world_size"]
    params = dict(model.named_parameters())
    for g in layout(model, w):
        flat = torch.zeros(g.padded)
        for name, shape, offset, numel in g.slots:
            flat[offset:offset + numel] = params[name].reshape(-1)
        seen = torch.cat([ref_round_trip(flat[r * g.shard:(r + 1) * g.shard], block, bits) for r in range(w)])
        for name, shape, offset, numel in g.slots:
            params[name].copy_(seen[offset:offset + numel].view(shape))
    x = _recipe_micro_batches()[0]
    return model(input_ids=x, labels=x).loss.item()


# Plain stage 3 of this recipe lands within 1e-6 of plain_training on every loss (measured 9.5e-7): the first loss
# is checked to FIRST_LOSS_ATOL, well below what int8 weights change it by (3e-5 here, asserted below).
FIRST_LOSS_ATOL = 5e-6


@pytest.mark.slow
@pytest.mark.needs_root
def test_zeropp_across_two_hosts_reduces_in_two_hops(two_hosts):
    """ZeRO++ (hpZ over the host, int8 weights, int4 gradients) across the two hosts, against plain single-process
    training (plain_training), never against another hf_zero run:
    - the first loss (before any gradient) is the one plain PyTorch computes with each rank's shard quantized to
      int8 and dequantized by the reference quantizer, within FIRST_LOSS_ATOL: qwZ's gather is exactly the stated
      quantizer (the per-step loss band below cannot see it: on this near-uniform tiny model, gathering every
      weight 10% too large moves the losses by 0.006);
    - every loss stays within docs/zeropp.md's ZeRO++ bound (int4 gradients: 0.08) of plain training;
    - qgZ reduces inside each host over the whole bucket, then across hosts over the host sums, so each
      reduce-scatter books P elements intra-host and P/2 inter-host; the backward's all-gathers stay inside the
      host (hpZ), the forward's cross it."""
    want = plain_training()
    first = first_loss_with_quantized_weights(8)
    assert abs(first - want[0]) > 4 * FIRST_LOSS_ATOL, (first, want[0])  # the check below can tell int8 from fp32
    config = {"stage": 3, "hpz_partition_size": "host", "quantized_weights": "int8", "quantized_gradients": "int4"}
    _, results = train_on_two_hosts(two_hosts, accelerate_on_two_hosts, "accelerate", [config])
    ours = results[0]
    assert len(ours["losses"]) == len(want) == 6, (ours["losses"], want)
    assert abs(ours["losses"][0] - first) <= FIRST_LOSS_ATOL, (ours["losses"][0], first, want[0])
    gap = max(abs(a - b) for a, b in zip(ours["losses"], want))
    assert gap <= 0.08, (gap, ours["losses"], want)
    for x in ours["ranks"]:
        step = x["comm_last_step"]
        rs, ag = step["reduce_scatter"], step["all_gather"]
        assert rs["inter_elements"] > 0 and rs["intra_elements"] == 2 * rs["inter_elements"], (x["rank"], rs)
        assert ag["intra_elements"] > 0 and ag["inter_elements"] > 0, (x["rank"], ag)  # hpZ backward / forward


@pytest.mark.slow
@pytest.mark.parametrize("attempt", ATTEMPTS)
@pytest.mark.needs_root
def test_two_hosts_stage3_ends_cleanly(two_hosts, single_host, attempt):
    """The reported failure: a two-host stage-3 run whose worker aborted at exit ("terminate called without an
    active exception", SIGABRT) while the other host sat in torchrun's exit barrier. Stage 3 alone, so nothing
    but its own teardown follows the training."""
    ref = single_host("accelerate", STAGES)[2]
    ending = ("return", "end_training")[attempt % 2]  # the exit hook's path first, then end_training's
    _, results = train_on_two_hosts(two_hosts, accelerate_on_two_hosts, "accelerate", [{"stage": 3}], ending=ending)
    assert_same_training(results[0], ref)


@pytest.mark.slow
def test_gloo_threads_are_gone_before_the_interpreter_finalizes(single_host):
    """The cause of the reported abort, checked without waiting for the race to strike: once every exit hook has
    run, no rank may still run gloo's threads (pt_gloo_runloop, gloo_tcp_loop), or one of them can take the GIL
    during finalization and abort the process. Both endings: end_training(), and a script that just returns."""
    left = {}
    for api, ending in (("accelerate", "end_training"), ("trainer", "return")):
        _, out = single_host(api, STAGES, ending=ending, with_dir=True)
        for rank in range(4):
            with open(os.path.join(out, f"exit_threads_rank{rank}.json")) as f:
                gloo = [name for name in json.load(f) if "gloo" in name]
            if gloo:
                left[f"{api}/{ending}/rank{rank}"] = gloo
    assert not left, f"gloo threads still running after every exit hook: {left}"


# ------------------------------------------------------------------------------------------------ the main job
def _finetune_args(output_dir):
    return [FINETUNE, "--tiny", "--zero_stage", "3", "--max_steps", str(FINETUNE_STEPS), "--warmup_steps", "1",
            "--eval_steps", "2", "--max_eval_samples", "8", "--max_new_tokens", "6", "--output_dir", output_dir]


@pytest.mark.slow
@pytest.mark.needs_root
def test_finetune_example_two_hosts_equals_one_host(two_hosts, tmp_path):
    h = two_hosts
    runs = h.run(accelerate_on_two_hosts(h, _finetune_args(os.path.join(h.disk, "run"))),
                 timeout=RUN_TIMEOUT_S, peer_grace=PEER_GRACE_S)
    assert_clean_exit(runs)
    assert "hf_zero fine-tuning summary" in runs[0].stdout, runs[0].describe()
    assert "| ZeRO stage 3 | 4 process(es)" in runs[0].stdout, runs[0].describe()
    with open(os.path.join(h.disk_of(0), "run", "summary.json")) as f:
        two = json.load(f)
    assert not os.path.exists(os.path.join(h.disk_of(1), "run", "summary.json"))  # the main process saves
    # host B had no copy of the --tiny tokenizer and model on its disk: its first process built its own
    cache_b = os.listdir(os.path.join(h.disk_of(1), "cache"))
    assert any(n.startswith("tiny-bpe") for n in cache_b) and any(n.startswith("tiny-llama") for n in cache_b), cache_b

    ref_dir = str(tmp_path / "one_host")
    os.makedirs(ref_dir)
    local = accelerate_on_one_host(ref_dir, _finetune_args(os.path.join(ref_dir, "run")))
    assert "hf_zero fine-tuning summary" in local.stdout
    with open(os.path.join(ref_dir, "run", "summary.json")) as f:
        one = json.load(f)

    for s in (two, one):
        assert s["num_processes"] == 4 and s["zero_stage"] == 3 and s["steps"] == FINETUNE_STEPS, s["zero_config"]
        assert len(s["losses"]) == FINETUNE_STEPS and s["reload_matches_state_dict"], s["reload_mismatched_keys"]
        assert [e["step"] for e in s["evals"]] == [0, 2, FINETUNE_STEPS]
    assert two["train_blocks"] == one["train_blocks"] and two["eval_blocks"] == one["eval_blocks"]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([e["eval_loss"] for e in two["evals"]]),
                               torch.tensor([e["eval_loss"] for e in one["evals"]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([h_["grad_norm"] for h_ in two["history"]]),
                               torch.tensor([h_["grad_norm"] for h_ in one["history"]]), rtol=1e-5, atol=1e-6)
    assert two["comm_elements_per_step"] == one["comm_elements_per_step"]
