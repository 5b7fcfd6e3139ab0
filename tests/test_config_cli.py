"""`hf-zero config`: interactive (stdin and a pty) and flag-driven writes, launches of what it writes, wrong inputs.

Every file goes to tmp_path (`--config-file`, `--zero-config-file`) and every subprocess gets HF_HOME in tmp_path,
so the user's ~/.cache is never read or written. The two `accelerate launch` runs check the point of the command:
the written Accelerate YAML starts exactly `num_processes` ranks on this CPU machine, forming one gloo world.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hf_zero.cli import main
from hf_zero.config import ZeroConfigError
from hf_zero.integrations.plugin import CONFIG_ENV, ZeroPlugin

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

PROBE = textwrap.dedent("""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from hf_zero import HfZeroAccelerator

    acc = HfZeroAccelerator()
    t = torch.tensor([float(acc.process_index + 1)])
    dist.all_reduce(t)  # one world: the sum over all ranks
    report = json.dumps({
        "WORLD_SIZE": int(os.environ["WORLD_SIZE"]), "RANK": int(os.environ["RANK"]),
        "dist_world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "num_processes": acc.num_processes, "all_reduce": t.item(),
        "stage": acc.zero_plugin.stage, "prefetch": acc.zero_plugin.prefetch,
        "offload_optimizer": acc.zero_plugin.offload_optimizer,
    })
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:  # one file per process
        f.write(report)
    dist.destroy_process_group()
    os._exit(0)  # torch's gloo/store threads now and then abort interpreter teardown; the report is written
""")


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "HF_ZERO_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.update(extra)
    return env


def _hf_zero_config(tmp_path: Path, *flags: str, stdin: str = "", **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_zero.cli", "config", *flags], input=stdin, text=True,
                          capture_output=True, env=_env(tmp_path), cwd=tmp_path, timeout=120, **kw)


def _paths(tmp_path: Path):
    acc, zero = tmp_path / "cfg" / "accelerate.yaml", tmp_path / "cfg" / "hf_zero.yaml"
    return acc, zero, ["--config-file", str(acc), "--zero-config-file", str(zero)]


def _launch(tmp_path: Path, acc: Path, zero: Path) -> list:
    """`accelerate launch --config_file acc probe.py OUT` (no launcher flags); every started process's report."""
    script, out = tmp_path / "probe.py", tmp_path / "reports"
    script.write_text(PROBE)
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(acc), str(script),
         str(out)],
        text=True, capture_output=True, env=_env(tmp_path, **{CONFIG_ENV: str(zero)}), cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = [json.loads(p.read_text()) for p in out.iterdir()]
    return sorted(reports, key=lambda r: r["RANK"])


def _assert_one_world(reports: list, n: int, **zero) -> None:
    assert [r["RANK"] for r in reports] == list(range(n)), reports  # exactly n processes, not 1, not n worlds of 1
    for r in reports:
        assert r["WORLD_SIZE"] == r["dist_world_size"] == r["num_processes"] == n
        assert r["backend"] == "gloo"
        assert r["all_reduce"] == n * (n + 1) / 2  # the ranks reduce together
        for key, value in zero.items():
            assert r[key] == value, (key, r)


# ------------------------------------------------------------------------------------------------ written + launched
def test_flags_write_both_files_and_launch_starts_two_gloo_ranks(tmp_path):
    acc, zero, paths = _paths(tmp_path)
    proc = _hf_zero_config(tmp_path, "--yes", "--stage", "3", "--offload-optimizer", "cpu", "--offload-params", "none",
                           "--activation-checkpointing", "on", "--reduce-bucket-size", "1000000",
                           "--allgather-bucket-size", "2_000_000", "--prefetch", "2", "--num-processes", "2",
                           "--mixed-precision", "no", "--cpu", *paths)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "?" not in proc.stdout  # --yes: nothing asked
    data = yaml.safe_load(acc.read_text())
    assert data["distributed_type"] == "MULTI_GPU" and data["use_cpu"] is True and data["num_processes"] == 2
    plugin = ZeroPlugin.from_yaml(zero)
    assert (plugin.stage, plugin.offload_optimizer, plugin.offload_params, plugin.activation_checkpointing,
            plugin.reduce_bucket_size, plugin.allgather_bucket_size, plugin.prefetch) == (
        3, "cpu", "none", "on", 1_000_000, 2_000_000, 2)
    assert "starts: 2 processes" in proc.stdout and "gloo" in proc.stdout
    # atomic writes leave no temp files behind, and the files are readable like any file open() writes
    assert sorted(p.name for p in acc.parent.iterdir()) == ["accelerate.yaml", "hf_zero.yaml"]
    assert acc.stat().st_mode & stat.S_IRUSR and acc.stat().st_mode & 0o777 != 0o600

    _assert_one_world(_launch(tmp_path, acc, zero), 2, stage=3, prefetch=2, offload_optimizer="cpu")


STDIN_MULTI_CPU = "\n".join([
    # Accelerate's own questions (its menus read the choice's index when stdin is not a terminal)
    "1",      # Which type of machine: multi-CPU
    "",       # How many machines [1]
    "",       # check distributed operations [NO]
    "",       # launch mpirun [NO]
    "",       # torch dynamo [NO]
    "2",      # How many processes
    "0",      # mixed precision: no
    # hf_zero's questions, each first answered wrongly
    "7", "3",                 # stage
    "gpu", "cpu",             # offload optimizer
    "disk", "none",           # offload params (stage 3 only)
    "maybe", "on",            # activation checkpointing
    "perhaps", "no",          # cpu checkpointing
    "abc", "1000000",         # reduce bucket size
    "-5", "",                 # all-gather bucket size (default)
    "-1", "2",                # prefetch
]) + "\n"


def test_interactive_stdin_multi_cpu_answer_still_starts_two_ranks(tmp_path):
    acc, zero, paths = _paths(tmp_path)
    proc = _hf_zero_config(tmp_path, *paths, stdin=STDIN_MULTI_CPU)
    out = ANSI.sub("", proc.stdout)
    assert proc.returncode == 0, out + proc.stderr
    assert "Which type of machine are you using?" in out  # Accelerate's questionnaire, not a copy
    for message in ("stage must be one of 0, 1, 2, 3; got '7'", "offload optimizer must be one of none, cpu",
                    "offload params must be one of none, cpu", "must be one of off, on, partitioned",
                    "answer yes or no", "reduce bucket size must be a positive integer",
                    "all-gather bucket size must be a positive integer", "prefetch must be an integer >= 0"):
        assert message in out, message
    assert out.count("Please answer again") == 8
    assert "starts ONE process for `distributed_type: MULTI_CPU`" in out  # the trap, explained
    data = yaml.safe_load(acc.read_text())
    assert (data["distributed_type"], data["use_cpu"], data["num_processes"]) == ("MULTI_GPU", True, 2)
    plugin = ZeroPlugin.from_yaml(zero)
    assert (plugin.stage, plugin.offload_optimizer, plugin.offload_params, plugin.activation_checkpointing,
            plugin.cpu_checkpointing, plugin.reduce_bucket_size, plugin.allgather_bucket_size, plugin.prefetch) == (
        3, "cpu", "none", "on", False, 1_000_000, ZeroPlugin().allgather_bucket_size, 2)

    _assert_one_world(_launch(tmp_path, acc, zero), 2, stage=3, prefetch=2)


def test_interactive_fsdp_answer_is_explained_and_replaced(tmp_path):
    acc, zero, paths = _paths(tmp_path)
    answers = [
        "4", "", "", "",      # multi-GPU, 1 machine, no debug, no dynamo
        "no", "yes",          # DeepSpeed no, FSDP yes
        "", "", "", "", "", "", "", "", "", "",  # FSDP's own questions: defaults
        "2",                  # How many GPU(s)
        "0",                  # mixed precision: no
        "maybe", "yes",       # switch to MULTI_GPU with hf_zero? (wrong answer first)
        "1", "", "", "", "", "",  # stage 1, the rest defaults (no offload-params / prefetch question at stage 1)
    ]
    proc = _hf_zero_config(tmp_path, *paths, stdin="\n".join(answers) + "\n")
    out = ANSI.sub("", proc.stdout)
    assert proc.returncode == 0, out + proc.stderr
    assert "You picked FSDP. hf_zero replaces it" in out and "switch: answer yes or no; got 'maybe'" in out
    assert "Offload parameter shards" not in out and "Prefetch" not in out
    data = yaml.safe_load(acc.read_text())
    assert data["distributed_type"] == "MULTI_GPU" and data["num_processes"] == 2
    assert "fsdp_config" not in data and "deepspeed_config" not in data
    assert ZeroPlugin.from_yaml(zero).stage == 1


def test_interactive_pty_with_accelerate_menus(tmp_path):
    """The real terminal path: Accelerate's arrow-key menus (needs pexpect)."""
    import pexpect  # in the test extra
    acc, zero, paths = _paths(tmp_path)
    child = pexpect.spawn(sys.executable, ["-m", "hf_zero.cli", "config", *paths], env=_env(tmp_path),
                          cwd=str(tmp_path), encoding="utf-8", timeout=60, dimensions=(60, 200))
    down, enter = "\x1b[B", "\r"
    try:
        child.expect("Which type of machine"); child.send(down + enter)  # multi-CPU, by arrow key
        for prompt in ("How many different machines", "checked while running", "mpirun", "torch dynamo"):
            child.expect(prompt); child.send(enter)
        child.expect("How many processes"); child.send("2" + enter)
        child.expect("mixed precision"); child.send("2" + enter)  # the number key: bf16
        child.expect("ZeRO stage"); child.send("9" + enter)
        child.expect("stage must be one of 0, 1, 2, 3"); child.expect("ZeRO stage"); child.send("2" + enter)
        child.expect("Offload optimizer"); child.send(enter)
        child.expect("Activation checkpointing"); child.send("on" + enter)
        child.expect("cpu checkpointing"); child.send("yes" + enter)  # asked only when checkpointing is on
        for prompt in ("Reduce", "All-gather"):
            child.expect(prompt); child.send(enter)
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before
    data = yaml.safe_load(acc.read_text())
    assert (data["distributed_type"], data["use_cpu"], data["num_processes"], data["mixed_precision"]) == (
        "MULTI_GPU", True, 2, "bf16")
    plugin = ZeroPlugin.from_yaml(zero)
    assert (plugin.stage, plugin.activation_checkpointing, plugin.cpu_checkpointing) == (2, "on", True)


def test_input_ending_early_writes_nothing(tmp_path):
    acc, zero, paths = _paths(tmp_path)
    proc = _hf_zero_config(tmp_path, *paths, stdin="1\n\n\n\n\n2\n0\n3\n")  # stops inside the ZeRO questions
    assert proc.returncode == 1
    assert "nothing was written" in proc.stderr
    assert not acc.exists() and not zero.exists()


# ------------------------------------------------------------------------------------------------ flag errors
@pytest.mark.parametrize("flags, named, allowed", [
    (["--stage", "7"], "--stage", "0, 1, 2, 3"),
    (["--stage", "two"], "--stage", "0, 1, 2, 3"),
    (["--offload-optimizer", "gpu"], "--offload-optimizer", "none, cpu"),
    (["--offload-params", "nvme"], "--offload-params", "none, cpu"),
    (["--activation-checkpointing", "yes"], "--activation-checkpointing", "off, on, partitioned"),
    (["--mixed-precision", "fp8"], "--mixed-precision", "no, bf16, fp16"),
    (["--reduce-bucket-size", "-1"], "--reduce-bucket-size", "positive integer"),
    (["--allgather-bucket-size", "lots"], "--allgather-bucket-size", "positive integer"),
    (["--prefetch", "-2"], "--prefetch", "integer >= 0"),
    (["--num-processes", "0"], "--num-processes", "integer >= 1"),
    (["--shard-group-size", "all"], "--shard-group-size", '"host"'),
    (["--sequence-parallel-size", "0"], "--sequence-parallel-size", "integer >= 1"),
])
def test_invalid_flag_values_exit_2_naming_flag_and_allowed_values(tmp_path, capsys, flags, named, allowed):
    acc, zero, paths = _paths(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["config", "--yes", *flags, *paths])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and allowed in err, err
    assert not acc.exists() and not zero.exists()


def test_offload_params_below_stage_3_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    acc, zero, paths = _paths(tmp_path)
    assert main(["config", "--yes", "--stage", "1", "--offload-params", "cpu", *paths]) == 2
    err = capsys.readouterr().err
    assert "--offload-params cpu needs --stage 3" in err
    assert main(["config", "--yes", "--offload-params", "cpu", *paths]) == 2  # default stage 2
    assert "needs stage 3" in capsys.readouterr().err
    assert not acc.exists() and not zero.exists()


def test_hierarchical_flags_written_and_validated(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    acc, zero, paths = _paths(tmp_path)
    assert main(["config", "--yes", "--stage", "3", "--hpz-partition-size", "host", *paths]) == 0
    plugin = ZeroPlugin.from_yaml(zero)
    assert (plugin.hpz_partition_size, plugin.shard_group_size) == ("host", None)
    assert main(["config", "--yes", "--stage", "1", "--shard-group-size", "4", *paths]) == 0
    assert ZeroPlugin.from_yaml(zero).shard_group_size == 4
    capsys.readouterr()
    assert main(["config", "--yes", "--stage", "2", "--hpz-partition-size", "2", *paths]) == 2
    assert "hpz_partition_size=2 needs stage 3" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ --show
def test_show_reports_files_sources_and_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    acc, zero, paths = _paths(tmp_path)
    assert main(["config", "--yes", "--stage", "1", "--num-processes", "2", "--cpu", *paths]) == 0
    capsys.readouterr()
    assert main(["config", "--show", *paths]) == 0
    out = capsys.readouterr().out
    assert f"Accelerate config: {acc}  (--config-file)" in out
    assert f"hf_zero config: {zero}  (--zero-config-file)" in out
    assert "distributed_type: MULTI_GPU" in out and "stage: 1" in out and "effective: stage=1" in out
    assert "starts: 2 processes" in out and f"{CONFIG_ENV}={zero}" in out

    # the config `accelerate config` writes for multi-CPU: one process, said as a problem
    acc.write_text(yaml.safe_dump({"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU",
                                   "num_processes": 2, "use_cpu": True, "mixed_precision": "no"}))
    zero.write_text("zero:\n  stage: 7\n")
    assert main(["config", "--show", *paths]) == 1
    out = capsys.readouterr().out
    assert "starts: ONE process" in out and "PROBLEM" in out and "num_processes=2" in out
    assert "INVALID" in out and "stage=7" in out and "0, 1, 2 or 3" in out

    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "nowhere.yaml"))
    assert main(["config", "--show", "--config-file", str(acc)]) == 1
    out = capsys.readouterr().out
    assert f"({'$' + CONFIG_ENV})" in out and "FileNotFoundError" in out


# ------------------------------------------------------------------------------------------------ wrong hf_zero.yaml
def _accelerator_error(monkeypatch, path: Path):
    """HfZeroAccelerator reads $HF_ZERO_CONFIG_FILE before it builds any Accelerate state."""
    from hf_zero import HfZeroAccelerator

    monkeypatch.setenv(CONFIG_ENV, str(path))
    with pytest.raises((ZeroConfigError, FileNotFoundError)) as exc:
        HfZeroAccelerator()
    return exc.value


def test_stage_7_in_hf_zero_yaml(tmp_path, monkeypatch):
    path = tmp_path / "hf_zero.yaml"
    path.write_text("zero:\n  stage: 7\n")
    from_yaml = pytest.raises(ZeroConfigError, ZeroPlugin.from_yaml, path).value
    for exc in (_accelerator_error(monkeypatch, path), from_yaml):
        assert isinstance(exc, ZeroConfigError)
        assert "stage" in str(exc) and "0, 1, 2 or 3" in str(exc) and str(path) in str(exc)


def test_unknown_key_in_hf_zero_yaml(tmp_path, monkeypatch):
    path = tmp_path / "hf_zero.yaml"
    path.write_text("zero:\n  stage: 2\n  zero_stage: 3\n")
    exc = _accelerator_error(monkeypatch, path)
    assert "unknown key" in str(exc) and "zero_stage" in str(exc) and "allowed keys" in str(exc)


def test_offload_params_at_stage_1_in_hf_zero_yaml(tmp_path, monkeypatch):
    path = tmp_path / "hf_zero.yaml"
    path.write_text("zero:\n  stage: 1\n  offload_params: cpu\n")
    exc = _accelerator_error(monkeypatch, path)
    assert "offload_params" in str(exc) and "stage 3" in str(exc)


def test_missing_file_named_by_env(tmp_path, monkeypatch):
    path = tmp_path / "missing" / "hf_zero.yaml"
    exc = _accelerator_error(monkeypatch, path)
    assert isinstance(exc, FileNotFoundError)
    assert str(path) in str(exc) and "hf-zero config" in str(exc) and CONFIG_ENV in str(exc)


# ------------------------------------------------------------------------------------------------ declared options
def test_every_option_flag_reaches_hf_zero_yaml(tmp_path, capsys, monkeypatch):
    """Options without a question are flags too (one declaration each, hf_zero/options)."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    acc, zero, paths = _paths(tmp_path)
    assert main(["config", "--yes", "--collectives", "flat", "--grad-accum-dtype", "compute", "--reduce-dtype", "fp32",
                 "--debug-collectives", "--units", "GPT2Block,LlamaDecoderLayer", "--loss-scale-factor", "4",
                 "--optimizer-is-elementwise", *paths]) == 0
    plugin = ZeroPlugin.from_yaml(zero)
    assert (plugin.collectives, plugin.grad_accum_dtype, plugin.reduce_dtype, plugin.debug_collectives, plugin.units,
            plugin.loss_scale_factor, plugin.optimizer_is_elementwise) == (
        "flat", "compute", "fp32", True, ["GPT2Block", "LlamaDecoderLayer"], 4.0, True)
    assert plugin.to_zero_config("no").collectives == "flat"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["config", "--yes", "--collectives", "ring", *paths])
    assert exc.value.code == 2 and "--collectives" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ --from-deepspeed
DS_CONFIG = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "reduce_bucket_size": 5e6, "stage3_prefetch_bucket_size": "auto",
                          "zero_hpz_partition_size": 2, "zero_quantized_weights": True},
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True},
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": "auto",
}


def _ds_file(tmp_path: Path, data: dict = DS_CONFIG) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_from_deepspeed_writes_both_files(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    acc, zero, paths = _paths(tmp_path)
    ds = _ds_file(tmp_path)
    assert main(["config", "--yes", "--from-deepspeed", ds, "--prefetch", "3", "--num-processes", "2", "--cpu",
                 *paths]) == 0
    out = capsys.readouterr().out
    plugin = ZeroPlugin.from_yaml(zero)
    assert (plugin.stage, plugin.offload_optimizer, plugin.reduce_bucket_size, plugin.hpz_partition_size,
            plugin.activation_checkpointing, plugin.cpu_checkpointing, plugin.prefetch) == (
        3, "cpu", 5_000_000 * 2, 2, "on", True, 3)  # bf16 elements: 2 bytes; the flag wins over the file
    assert yaml.safe_load(acc.read_text())["mixed_precision"] == "bf16"  # the file's own precision
    assert "mixed_precision set to bf16 (bf16.enabled=true" in out
    assert f"From the DeepSpeed config {ds}" in out
    assert plugin.quantized_weights == "int8" and "zero_quantized_weights" not in out  # ZeRO++ qwZ, honoured
    assert "gradient_accumulation_steps=4: HfZeroAccelerator(gradient_accumulation_steps=4)" in out
    assert "gradient_clipping=1.0: accelerator.clip_grad_norm_" in out


def test_from_deepspeed_values_are_the_questions_defaults(tmp_path):
    acc, zero, paths = _paths(tmp_path)
    # Accelerate's side from flags; every ZeRO question answered with Enter
    proc = _hf_zero_config(tmp_path, "--from-deepspeed", _ds_file(tmp_path), "--num-processes", "1", "--cpu", *paths,
                           stdin="\n" * 10)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ZeRO stage: 0 plain data parallel, 1 + optimizer states, 2 + gradients, 3 + parameters (0/1/2/3) [3]" \
           in proc.stdout and "[cpu]" in proc.stdout and "Prefetch" in proc.stdout
    plugin = ZeroPlugin.from_yaml(zero)
    assert (plugin.stage, plugin.offload_optimizer, plugin.cpu_checkpointing, plugin.reduce_bucket_size) == (
        3, "cpu", True, 10_000_000)


@pytest.mark.parametrize("data, flags, message", [
    ({"zero_optimization": {"stage": 7}}, [], "zero_optimization.stage=7"),
    ({"bf16": {"enabled": True}}, ["--mixed-precision", "fp16"], "make them agree"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, ["--stage", "2"],
     "hpz_partition_size=2 needs stage 3"),
    (None, [], "does not exist"),
])
def test_from_deepspeed_errors_exit_2(tmp_path, capsys, monkeypatch, data, flags, message):
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    acc, zero, paths = _paths(tmp_path)
    ds = _ds_file(tmp_path, data) if data is not None else str(tmp_path / "missing.json")
    assert main(["config", "--yes", "--from-deepspeed", ds, *flags, *paths]) == 2
    assert message in capsys.readouterr().err
    assert not acc.exists() and not zero.exists()


@pytest.mark.parametrize("flags, answers, expected, says", [
    (["--stage", "3"], ["hpz"], {"hpz_partition_size": "host", "shard_group_size": None}, ""),
    (["--stage", "2"], ["HSDP"], {"hpz_partition_size": None, "shard_group_size": "host"}, ""),
    (["--stage", "2"], ["ring", ""], {"hpz_partition_size": None, "shard_group_size": None}, "Not allowed"),
    (["--stage", "2"], ["hpz"], {"hpz_partition_size": None, "shard_group_size": None},
     "hpz_partition_size='host' needs stage 3"),
    (["--stage", "0"], [], {"hpz_partition_size": None, "shard_group_size": None}, ""),  # not asked
    (["--stage", "3", "--shard-group-size", "2"], [], {"hpz_partition_size": None, "shard_group_size": 2}, ""),
])
def test_several_machines_ask_the_hierarchy_question(monkeypatch, capsys, flags, answers, expected, says):
    """hf-zero config on several machines asks the declared `hierarchy` question once the stage allows it; an answer
    sets its option to "host" if that option's own requirements are met, and says why not otherwise."""
    import argparse

    from hf_zero.integrations import config_cli
    from hf_zero.options import PLUGIN

    parser = argparse.ArgumentParser()
    config_cli.add_arguments(parser)
    args = parser.parse_args(flags)
    asked = []

    def answer(prompt):
        asked.append(prompt)
        if "machines" not in prompt:
            return ""  # every other question: its default
        return answers[sum("machines" in p for p in asked) - 1]

    monkeypatch.setattr("builtins.input", answer)
    values = config_cli._ask_zero(args, {o.name: o.default for o in PLUGIN}, True, num_machines=2)
    assert {k: values[k] for k in expected} == expected
    hierarchy_prompts = [p for p in asked if "machines" in p]
    assert len(hierarchy_prompts) == len(answers)
    if answers:
        assert hierarchy_prompts[0].startswith("2 machines: keep all-gathers inside each host?")
        assert hierarchy_prompts[0].endswith("(none/hsdp/hpz) [none]: ")
    out = capsys.readouterr().out
    assert says in out
    if "needs stage 3" in says:
        assert "keeping the plain stage" in out
