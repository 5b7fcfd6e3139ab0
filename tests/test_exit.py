"""Every entry point ends cleanly (issue 19, item 8): a plain `shard_model` script, under torchrun and under
torch.multiprocessing.spawn, with or without its own destroy_process_group(), must not abort at exit.

The abort ("terminate called without an active exception", SIGABRT after a correct run) comes from gloo's threads
living into interpreter finalization (hf_zero/engine/exit.py says why). It is a race, so two kinds of test:

- deterministic (always runs): every rank reports the threads it still runs after every other exit hook
  (tests/scripts/exit_shard_model.py --exit-report, registered first so it runs last), and whether the engine it
  dropped and the process groups hf_zero made for it are still alive then; no gloo thread may be among them, and
  nothing of the engine's alive. It covers both launchers (torchrun, torch.multiprocessing.spawn) with the reported
  scripts (stage 1 with frozen parameters and destroy_process_group(); stage 3 with CPU activation checkpoints, the
  group left alive; 4 ranks of stage 3 with hpZ's host groups and destroy_process_group(), issue 45 item 6), plus
  the Accelerator API;
- the race itself, opt-in: HF_ZERO_EXIT_REPEAT=N (e.g. 50) runs N launches beside a busy CPU, none may lose a
  process to a signal or print "terminate called". It catches the race only a fraction of the time (it costs N
  launches to hope for one), so by default it is skipped and the deterministic test stands for it.

Neither may print torch.distributed.reduce_op's FutureWarning (the former exit hook walked every module's attributes
and printed it three times per rank). Output is checked whole, never a tail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(HERE, "scripts", "exit_shard_model.py")
LAUNCH_TIMEOUT_S = 180
# the race hunt's launches: 0 (unset) skips it; the deterministic test pins the cause
REPEAT = int(os.environ.get("HF_ZERO_EXIT_REPEAT", "0") or "0")
# the two reported scripts: torchrun, stage 1, frozen parameters, destroy_process_group() at the end; spawn, stage 3,
# partitioned activation checkpoints on the CPU, the group left alive
TORCHRUN_STAGE1 = ("torchrun", ["--stage", "1", "--frozen", "--destroy"])
SPAWN_STAGE3 = ("spawn", ["--stage", "3", "--checkpointing"])
# issue 45 item 6, on 4 ranks: stage 3 with hpZ's host groups of 2 (made by dist.new_group), destroy_process_group()
SPAWN_HPZ = ("spawn", ["--stage", "3", "--hpz", "2", "--destroy"])


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HF_ZERO_CONFIG_FILE"):
        env.pop(key, None)
    return env


def launch(launcher: str, args, cwd, world: int = 2) -> subprocess.CompletedProcess:
    """One launch of the script on `world` ranks; torchrun --standalone takes a port the OS hands out, spawn a
    FileStore."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), SCRIPT,
               *args]
    else:
        cmd = [sys.executable, SCRIPT, "--spawn", str(world), *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=str(cwd))


def problems(launcher: str, res: subprocess.CompletedProcess, world: int = 2) -> list:
    """What is wrong with how a launch ended, read from its whole output."""
    found = []
    if res.returncode != 0:
        found.append(f"exit code {res.returncode}")
    if launcher == "spawn":
        codes = [json.loads(line.split(" ", 1)[1]) for line in res.stdout.splitlines()
                 if line.startswith("EXIT_CODES ")]
        if codes != [[0] * world]:
            found.append(f"rank exit codes {codes} (negative: ended by that signal)")
    elif "exitcode" in res.stderr and "Signal" in res.stderr:  # torchrun's failure summary for a signalled worker
        found.append("a worker ended by a signal")
    if "terminate called" in res.stderr:
        found.append("'terminate called' in stderr")
    if "reduce_op" in res.stderr:
        found.append("torch.distributed.reduce_op FutureWarning in stderr")
    if res.stdout.count("EXIT_SCRIPT rank=") != world:
        found.append("not every rank finished training")
    return found


@pytest.mark.parametrize("launcher,args,world", [(*TORCHRUN_STAGE1, 2), (*SPAWN_STAGE3, 2),
                                                 ("torchrun", ["--stage", "3", "--checkpointing"], 2),
                                                 ("spawn", ["--stage", "1", "--frozen", "--destroy"], 2),
                                                 ("torchrun", ["--api", "accelerate", "--stage", "2"], 2),
                                                 (*SPAWN_HPZ, 4)],
                         ids=["torchrun-stage1-destroy", "spawn-stage3-ckpt", "torchrun-stage3-ckpt",
                              "spawn-stage1-destroy", "torchrun-accelerator-stage2", "spawn-4-ranks-hpz2-destroy"])
def test_no_gloo_thread_outlives_the_exit_hooks(tmp_path, launcher, args, world):
    """No gloo thread, and (scripts that build the engine themselves) neither the engine the script dropped nor a
    process group hf_zero made for it, is alive once every other exit hook has run: hf_zero's hook freed them
    before finalization. hpZ's host groups (dist.new_group) were held by their Comms' control plane past the hook
    (issue 45 item 6: such 4-rank launches sometimes aborted)."""
    report = tmp_path / "threads"
    report.mkdir()
    res = launch(launcher, [*args, "--exit-report", str(report)], tmp_path, world)
    assert not problems(launcher, res, world), f"{problems(launcher, res, world)}\n{res.stdout}\n{res.stderr}"
    left, alive = {}, {}
    for rank in range(world):
        out = json.loads((report / f"threads_rank{rank}.json").read_text())
        gloo = [n for n in out["threads"] if "gloo" in n]
        if gloo:
            left[rank] = gloo
        if any(out["alive"].values()):
            alive[rank] = out["alive"]
        if "--api" not in args:  # the script watched its engine (and hpZ's groups: the check can see them)
            assert out["watched"]["engine"] == 1 and (out["watched"]["groups"] > 0) == ("--hpz" in args), out
    assert not left, f"gloo threads still running when the interpreter finalizes: {left}\n{res.stderr}"
    assert not alive, f"the engine or its groups still alive when the interpreter finalizes: {alive}"


DEFAULTS_PROBE = textwrap.dedent("""
    import importlib, json, os, pkgutil, sys, tempfile, types, warnings
    import torch, torch.distributed as dist
    import hf_zero  # before the process group, as a script imports it
    from hf_zero.engine import exit as hz_exit
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0,
                            world_size=1)
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # imports torch._dynamo, as a script's optimizer does
    if sys.argv[1] == "everything":
        warnings.simplefilter("ignore")
        import torch.distributed
        for info in pkgutil.walk_packages(torch.distributed.__path__, "torch.distributed."):
            if ".testing" in info.name or "_test" in info.name:
                continue
            try:
                importlib.import_module(info.name)
            except Exception:
                pass
        for name in ("accelerate", "accelerate.accelerator", "accelerate.checkpointing", "transformers.trainer",
                     "peft", "trl", "deepspeed", "deepspeed.comm", "deepspeed.comm.torch"):
            try:  # what a training script may import after the group exists (DeepSpeed where it is installed)
                importlib.import_module(name)
            except Exception:
                pass

    def holders():
        out = set()
        for name, module in list(sys.modules.items()):
            members = getattr(module, "__dict__", None)
            if not isinstance(members, dict):
                continue
            for member in list(members.values()):
                fns = list(vars(member).values()) if issubclass(type(member), type) else [member]
                for fn in fns:
                    fn = fn.__func__ if type(fn) in (staticmethod, classmethod) else fn
                    if type(fn) is types.FunctionType:
                        values = list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
                        if any(type(v) is dist.ProcessGroup for v in values):
                            out.add((fn.__module__, fn.__qualname__))
        return sorted(out)

    before = holders()
    hz_exit.release_process_groups()
    threads = []
    for tid in os.listdir("/proc/self/task"):
        try:
            threads.append(open(f"/proc/self/task/{tid}/comm").read().strip())
        except OSError:
            pass
    print(json.dumps({"before": before, "after": holders(), "initialized": dist.is_initialized(),
                      "gloo_threads": [t for t in threads if "gloo" in t],
                      "listed": list(hz_exit.UPSTREAM_GROUP_DEFAULTS)}))
""")


def _probe_defaults(tmp_path, what: str) -> dict:
    res = subprocess.run([sys.executable, "-c", DEFAULTS_PROBE, what], env=_env(), capture_output=True, text=True,
                         timeout=300, cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_script_that_imports_hf_zero_first_leaves_no_group_in_torch_defaults(tmp_path):
    """The usual script: hf_zero imported, then init_process_group, then the optimizer (which imports
    torch._dynamo and with it torch.distributed.nn.functional). No function default holds the world group, and once
    the exit hook's work is done (release_process_groups) no gloo thread is left. hf_zero changes no default of
    torch's: it imported torch.distributed.nn.functional before the group existed (engine/exit.py)."""
    out = _probe_defaults(tmp_path, "usual")
    assert out["before"] == [], out
    assert not out["initialized"] and out["gloo_threads"] == [], out


@pytest.mark.slow
def test_upstream_group_defaults_lists_every_module_that_pins_the_world_group(tmp_path):
    """After init_process_group, import every module of torch.distributed, and Accelerate, Transformers' Trainer,
    PEFT, TRL and DeepSpeed where installed: the functions whose defaults then hold a ProcessGroup must all be in
    exit.UPSTREAM_GROUP_DEFAULTS (upstream's bug, named in docs/engine.md), none in torch.distributed.nn.functional
    (imported by hf_zero before the group existed). hf_zero no longer rewrites other libraries' defaults, so what
    those modules pin stays pinned, and the group's gloo threads stay with it: what this test shows is that they
    are the only holders left once the exit hook has run, not that the threads end (a script that imports them
    after init_process_group has to live with upstream's bug; docs/engine.md says what it can do)."""
    out = _probe_defaults(tmp_path, "everything")
    assert out["before"], "nothing pinned the world group: the check would pass whatever the list says"
    unlisted = [(m, q) for m, q in out["before"] if m not in out["listed"]]
    assert not unlisted, f"defaults holding a ProcessGroup in modules missing from UPSTREAM_GROUP_DEFAULTS: {unlisted}"
    assert not [m for m, _ in out["before"] if m == "torch.distributed.nn.functional"], out
    assert out["after"] == out["before"], "hf_zero changed another library's defaults"
    assert not out["initialized"], out


@pytest.mark.slow
@pytest.mark.skipif(REPEAT < 1, reason="race hunt, opt-in: set HF_ZERO_EXIT_REPEAT=N (e.g. 50) to run N launches "
                                       "under load; the deterministic test above pins the cause")
def test_no_abort_at_exit_in_repeated_launches_under_load(tmp_path):
    """REPEAT launches (HF_ZERO_EXIT_REPEAT), taking the three reported scripts in turn, each beside a process that
    keeps one core busy: no process may die by a signal or print "terminate called"."""
    # a busy loop bounded by its own clock, should this test be killed before it stops it
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.monotonic() + %d\n"
                             "while time.monotonic() < end: pass" % (REPEAT * LAUNCH_TIMEOUT_S)])
    failures, t0 = [], time.monotonic()
    try:
        for i in range(REPEAT):
            launcher, args, world = ((*TORCHRUN_STAGE1, 2), (*SPAWN_STAGE3, 2), (*SPAWN_HPZ, 4))[i % 3]
            res = launch(launcher, args, tmp_path, world)
            found = problems(launcher, res, world)
            if found:
                failures.append(f"launch {i} ({launcher} {' '.join(args)}): {found}\n{res.stderr}")
    finally:
        busy.kill()
        busy.wait()
    print(f"{REPEAT} launches in {time.monotonic() - t0:.0f} s, {len(failures)} failed")
    assert not failures, f"{len(failures)} of {REPEAT} launches did not end cleanly:\n" + "\n".join(failures)
