"""`hf-zero config`: Accelerate's own questionnaire, then the ZeRO questions; writes both config files.

Two files, because Accelerate rejects unknown keys in its YAML (DESIGN.md section 4):

* the Accelerate config (`--config-file`, default: Accelerate's default config file), written so that a plain
  `accelerate launch [--config_file X] script.py` starts the stated number of processes as ONE world;
* `hf_zero.yaml` (`--zero-config-file`, default: `default_config_path()`), written by `ZeroPlugin.to_yaml`.

The CPU trap. In Accelerate 1.15 `distributed_type: MULTI_CPU` (what `accelerate config` writes for "multi-CPU")
goes to the simple launcher, which starts ONE process unless mpirun is configured. A world of N gloo ranks on a
machine without GPUs comes from the multi-GPU launcher (torchrun) instead: `distributed_type: MULTI_GPU`,
`num_processes: N`, `use_cpu: true`. That launcher does not forward `use_cpu` to the ranks (no
`ACCELERATE_USE_CPU`); `HfZeroAccelerator` selects the CPU itself when WORLD_SIZE > 1 and no GPU is visible, so the
N ranks form one gloo world of size N. `hf-zero config` therefore writes MULTI_GPU + use_cpu for N > 1 CPU
processes, turns a MULTI_CPU answer without mpirun into that, and says so; `hf-zero config --show` tells what
`accelerate launch` will start from the files as they are.

Everything heavy (Accelerate, torch) is imported inside the functions: `hf-zero bench` builds this parser too.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..options import BY_NAME, HIERARCHICAL, PLUGIN, QUESTIONS, Choice, Flag, Integer, Option, asked, unmet
from .launch_plan import MIXED_PRECISION, distributed_type_name as _dt, launch_plan

# flags that describe the Accelerate side: given any of them (or --yes), Accelerate's questionnaire is skipped
_ACCELERATE_FLAGS = ("num_processes", "mixed_precision", "cpu")


class ConfigAbort(Exception):
    """The session ends without writing anything (input ended, the user gave up)."""


class ConfigUsageError(Exception):
    """Flags that are each valid but do not fit together: reported like an argparse error (exit 2)."""


# ---------------------------------------------------------------------------------------------------- parsing
def _parser(kind: Any, label: str) -> Callable[[str], Any]:
    """argparse type / prompt parser for a value kind of hf_zero.options (errors say what `label` takes)."""
    return lambda text: kind.parse(text, label)


_parse_mixed_precision = _parser(Choice(MIXED_PRECISION), "mixed precision")
_parse_num_processes = _parser(Integer(1, "processes in the world"), "num processes")


def _yes_no(label: str) -> Callable[[str], bool]:
    return _parser(Flag(), label)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `hf-zero config` flags: one per ZeroPlugin option (hf_zero.options), then the Accelerate side's; each
    multi-word flag also answers to its underscore spelling."""
    parser.description = (
        "Write the Accelerate config and hf_zero.yaml. Interactive: Accelerate's own questions, then the ZeRO ones. "
        "Flags answer their questions; with --yes nothing is asked (unset values take their defaults). Given "
        "--num-processes, --mixed-precision or --cpu, Accelerate's questions are skipped and its config is built "
        "from those flags.")

    def add(flag: str, **kwargs: Any) -> None:
        names = [flag] + (["--" + flag[2:].replace("-", "_")] if "-" in flag[2:] else [])
        parser.add_argument(*names, **kwargs)

    for o in PLUGIN:
        shown = "" if "default" in o.help.lower() else f" Default: {o.kind.plain(o.default)}."
        help_text = (o.help + shown).replace("%", "%%")
        if isinstance(o.kind, Flag):
            add(o.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            add(o.flag, type=o.parse, metavar=o.kind.metavar, help=help_text)
    add("--from-deepspeed", metavar="FILE", default=None,
        help="a DeepSpeed config JSON: its ZeRO settings become the defaults of the ZeRO questions (flags still win), "
             "its bf16/fp16 the Accelerate precision; keys hf_zero cannot take are listed with the reason")
    add("--num-processes", type=_parse_num_processes, metavar="N",
        help="processes in the world (default: the GPU count, or 1 on CPU)")
    add("--mixed-precision", type=_parse_mixed_precision, metavar="{" + ",".join(MIXED_PRECISION) + "}")
    add("--cpu", action=argparse.BooleanOptionalAction, default=None,
        help="train on CPU (gloo); default: on when no GPU is visible")
    parser.add_argument("--yes", "-y", action="store_true", help="ask nothing; unset values take their defaults")
    add("--config-file", metavar="PATH", default=None,
        help="the Accelerate config to write (default: Accelerate's default config file)")
    add("--zero-config-file", metavar="PATH", default=None,
        help="the hf_zero.yaml to write (default: $HF_ZERO_CONFIG_FILE, else beside Accelerate's default config)")
    add("--show", action="store_true",
        help="print both files, where they came from and what `accelerate launch` will start; write nothing")


def _flag_text(option: Option, value: Any) -> str:
    return f"{option.flag} {option.kind.show(value) if isinstance(option.kind, Flag) else value}"


def _check_flags(args: argparse.Namespace) -> None:
    """Flags that are each valid but do not fit together fail before any question is asked."""
    for o in PLUGIN:
        value = getattr(args, o.name)
        if value is None or value == o.default:
            continue
        for req in o.requires:
            other = getattr(args, req.other, None)
            if other is None or req.met(other, BY_NAME[req.other].default):
                continue
            detail = req.message.format(name=o.name, value=value, other=req.other, other_value=other)
            if req.allowed is None:
                raise ConfigUsageError(f"{_flag_text(o, value)} and {_flag_text(BY_NAME[req.other], other)} exclude "
                                       f"each other: {detail}")
            wanted = " or ".join(str(a) for a in req.allowed)
            raise ConfigUsageError(f"{_flag_text(o, value)} needs {BY_NAME[req.other].flag} {wanted}: {detail}")


# ---------------------------------------------------------------------------------------------------- prompts
def _ask(prompt: str, parse: Callable[[str], Any], default: Any) -> Any:
    """Ask until the answer parses; an empty answer takes the default. Every rejection says what is allowed."""
    while True:
        try:
            answer = input(prompt)
        except EOFError:
            print()
            raise ConfigAbort("input ended before every question was answered; nothing was written") from None
        if not answer.strip() and default is not None:
            return default
        try:
            return parse(answer)
        except argparse.ArgumentTypeError as exc:
            print(f"  Not allowed: {exc}. Please answer again.")


def _machine() -> Dict[str, Any]:
    import torch

    cuda = torch.cuda.is_available()
    return {"cuda": cuda, "gpus": torch.cuda.device_count() if cuda else 0}


def _ask_zero(args: argparse.Namespace, defaults: Dict[str, Any], interactive: bool,
              num_machines: int = 1) -> Dict[str, Any]:
    """The ZeRO answers: flags first, then (interactive) the declared questions in order, else the defaults. A
    question whose requirement the answers so far do not meet is skipped and its option keeps its default."""
    given = {o.name for o in PLUGIN if getattr(args, o.name) is not None}
    values = dict(defaults)
    values.update({name: getattr(args, name) for name in given})

    if interactive:
        print("\n---- hf_zero (ZeRO) ----")
    for o in QUESTIONS:
        if o.name in given:
            continue
        if not asked(o, values):
            if unmet(o, values) is not None:
                values[o.name] = o.default
            continue
        if interactive:
            default = values[o.name]
            values[o.name] = _ask(f"{o.question.text} [{o.kind.show(default)}]: ", o.parse, default)
    hierarchy = BY_NAME["hierarchy"]  # several hosts: keep all-gathers inside a host (docs/multihost.md)
    if interactive and num_machines > 1 and not set(HIERARCHICAL.values()) & given and asked(hierarchy, values):
        choice = _ask(f"{num_machines} machines: {hierarchy.question.text} [{hierarchy.default}]: ", hierarchy.parse,
                      hierarchy.default)
        if choice in HIERARCHICAL:
            target = BY_NAME[HIERARCHICAL[choice]]
            chosen = dict(values, **{target.name: "host"})
            req = unmet(target, chosen)
            if req is None:
                values = chosen
            else:  # the option's own requirement says why (hpz: stage 3)
                why = req.message.format(name=target.name, value="host", other=req.other,
                                         other_value=chosen[req.other])
                print(f"  {why.rstrip('.')}: keeping the plain stage")
    return values


# ---------------------------------------------------------------------------------------------------- Accelerate
def _cluster_config(num_processes: int, cpu: bool, mixed_precision: str) -> Any:
    """The Accelerate config for a single machine (what its questionnaire would return for these answers)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import ComputeEnvironment, DistributedType

    distributed = num_processes > 1
    return ClusterConfig(
        compute_environment=ComputeEnvironment.LOCAL_MACHINE,
        # N > 1 on CPU too: MULTI_CPU would start ONE process (module docstring)
        distributed_type=DistributedType.MULTI_GPU if distributed else DistributedType.NO,
        num_processes=num_processes, machine_rank=0, num_machines=1, gpu_ids="all", mixed_precision=mixed_precision,
        use_cpu=cpu, debug=False, rdzv_backend="static", same_network=True, main_training_function="main",
        enable_cpu_affinity=False, downcast_bf16="no", tpu_use_cluster=False, tpu_use_sudo=False,
    )


def _ask_accelerate(zero_defaults: Dict[str, Any]) -> Any:
    """Accelerate's own questionnaire (`get_cluster_input`, what `accelerate config` asks for "This machine"),
    re-asked until the answers describe a setup hf_zero can run."""
    from accelerate.commands.config.cluster import get_cluster_input
    from accelerate.commands.menu import selection_menu

    if not sys.stdin.isatty():
        # Accelerate's arrow-key menus need a terminal; its own fallback (used on Colab) reads the choice's index
        selection_menu.in_colab = True
    print("---- Accelerate (its own questions) ----")
    while True:
        try:
            config = get_cluster_input()
        except (EOFError, KeyboardInterrupt):
            raise
        except AssertionError as exc:
            if "DeepSpeed" in str(exc) or "deepspeed" in str(exc):
                print(f"\n{exc}\nhf_zero replaces DeepSpeed (its ZeRO questions come next): answer `no` to "
                      f"DeepSpeed and FSDP. Accelerate's questions again:")
            else:
                print(f"\nAccelerate rejected these answers: {exc}\nAccelerate's questions again:")
            continue
        except Exception as exc:  # ValueError (1 GPU for multi-GPU, ...), IndexError (menu index out of range)
            print(f"\nAccelerate rejected these answers: {type(exc).__name__}: {exc}\nAccelerate's questions again:")
            continue
        config = _reconcile(config, zero_defaults)
        if config is not None:
            return config
        print("\nAccelerate's questions again:")


def _reconcile(config: Any, zero_defaults: Dict[str, Any]) -> Optional[Any]:
    """Make the questionnaire's answer fit hf_zero; None: ask Accelerate's questions again."""
    from accelerate.utils import DistributedType

    dt = _dt(config)
    if dt in ("DEEPSPEED", "FSDP", "MEGATRON_LM"):
        name = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM"}[dt]
        print(f"\nYou picked {name}. hf_zero replaces it: ZeRO shards optimizer states, gradients and parameters "
              f"itself on top of plain data parallelism (Accelerate's MULTI_GPU launcher); with {name} selected, "
              f"Accelerate would switch backends and HfZeroAccelerator refuses to start.")
        switch = _ask("Use MULTI_GPU (plain data parallel) with hf_zero instead, keeping your other answers? "
                      "(yes: switch, no: answer Accelerate's questions again) [yes]: ", _yes_no("switch"), True)
        if not switch:
            return None
        settings = _read_deepspeed(_accelerate_deepspeed(config.deepspeed_config or {}), config.mixed_precision)
        zero_defaults.update(settings.plugin_kwargs())
        for line in settings.notes("hf-zero config"):
            print(f"  {line}")
        if config.num_processes is None or config.num_processes < 1:
            config.num_processes = 1
        config.distributed_type = (DistributedType.NO if config.num_processes == 1 and config.num_machines == 1
                                   else DistributedType.MULTI_GPU)
        config.deepspeed_config, config.fsdp_config, config.megatron_lm_config = {}, {}, {}
        config.parallelism_config = {}
        if config.gpu_ids is None:
            config.gpu_ids = "all"
        if config.mixed_precision is None:
            config.mixed_precision = "no"
        print(f"distributed_type set to {_dt(config)}.")
    elif dt == "MULTI_CPU":
        if (config.mpirun_config or {}).get("mpirun_hostfile"):
            print("\nNote: MULTI_CPU with mpirun: accelerate launch starts the ranks through mpirun (not verified "
                  "with hf_zero here).")
        elif config.num_processes <= 1 and config.num_machines == 1:
            config.distributed_type = DistributedType.NO
            config.use_cpu = True
            print("\nOne CPU process: distributed_type set to NO with use_cpu.")
        else:
            print(f"\nNote: Accelerate 1.15 starts ONE process for `distributed_type: MULTI_CPU` without mpirun, not "
                  f"{config.num_processes}. Writing `distributed_type: MULTI_GPU` with `use_cpu: true` instead: "
                  f"`accelerate launch` then starts {config.num_processes} processes (torchrun), and "
                  f"HfZeroAccelerator makes them one gloo world on CPU.")
            config.distributed_type = DistributedType.MULTI_GPU
            config.use_cpu = True
            config.gpu_ids = "all"
            config.mpirun_config = {}
    elif dt not in ("NO", "MULTI_GPU"):
        print(f"\nNote: distributed_type {dt}: hf_zero is tested on CPU (gloo) and CUDA GPUs (nccl) only.")
    if config.mixed_precision not in MIXED_PRECISION:
        print(f"\nmixed_precision={config.mixed_precision!r}: hf_zero supports no, bf16 and fp16 (fp32 master "
              f"weights inside the shards).")
        config.mixed_precision = _ask("Mixed precision for hf_zero? (no/bf16/fp16) [no]: ", _parse_mixed_precision,
                                      "no")
        config.fp8_config = {}
    return config


def _accelerate_from_flags(args: argparse.Namespace, machine: Dict[str, Any]) -> Any:
    cpu = args.cpu if args.cpu is not None else not machine["cuda"]
    n = args.num_processes
    if n is None:
        n = machine["gpus"] if (machine["gpus"] and not cpu) else 1
    return _cluster_config(n, cpu, args.mixed_precision or "no")


# ---------------------------------------------------------------------------------------------------- files
def _accelerate_path(args: argparse.Namespace) -> Tuple[Path, str]:
    if args.config_file:
        return Path(args.config_file), "--config-file"
    from accelerate.commands.config.config_args import default_config_file

    return Path(default_config_file), "Accelerate's default config file"


def _zero_path(args: argparse.Namespace) -> Tuple[Path, str]:
    from .plugin import CONFIG_ENV, default_config_path

    if args.zero_config_file:
        return Path(args.zero_config_file), "--zero-config-file"
    if os.environ.get(CONFIG_ENV):
        return default_config_path(), f"${CONFIG_ENV}"
    return default_config_path(), "default: beside Accelerate's default config"


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if path.exists():
            mode = path.stat().st_mode & 0o777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)  # mkstemp makes 0600; keep the old file's mode, else what open() would give
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _accelerate_text(config: Any, path: Path) -> str:
    import yaml

    data = copy.deepcopy(config).to_dict()  # to_dict converts enums in place: keep `config` intact
    if path.suffix == ".json":
        return json.dumps(data, indent=2, sort_keys=True) + "\n"
    return yaml.safe_dump(data)


def _machine_notes(config: Any, machine: Dict[str, Any]) -> List[str]:
    """Where the written Accelerate setup does not fit this machine."""
    notes = []
    dt, n = _dt(config), int(config.num_processes)
    if dt == "MULTI_GPU" and machine["cuda"] and config.use_cpu:
        notes.append(f"this machine has {machine['gpus']} GPU(s) and you asked for CPU: Accelerate's multi-GPU "
                     f"launcher does not pass use_cpu to the ranks, so they will use the GPUs unless you launch with "
                     f"ACCELERATE_USE_CPU=1 (or CUDA_VISIBLE_DEVICES=)")
    per_node = n // max(1, config.num_machines)
    if dt == "MULTI_GPU" and not config.use_cpu and machine["cuda"] and per_node > machine["gpus"]:
        notes.append(f"{n} processes but {machine['gpus']} GPU(s) visible here: every rank needs its own GPU")
    if dt == "MULTI_GPU" and not config.use_cpu and not machine["cuda"]:
        notes.append("no GPU is visible on this machine: HfZeroAccelerator will run the ranks on CPU with gloo")
    if config.mixed_precision == "fp16" and not machine["cuda"]:
        notes.append("fp16 on CPU is slow (and fp16 loss scaling buys nothing there); bf16 is the usual CPU choice")
    return notes


# ---------------------------------------------------------------------------------------------------- commands
def show(args: argparse.Namespace) -> int:
    """Both files with their paths and sources, and what `accelerate launch` will start. 0: all good, 1: not."""
    from .plugin import CONFIG_ENV, ZeroPlugin

    ok = True
    acc_path, acc_src = _accelerate_path(args)
    zero_path, zero_src = _zero_path(args)
    print(f"Accelerate config: {acc_path}  ({acc_src})")
    if acc_path.is_file():
        print(_indent(acc_path.read_text()))
    else:
        ok = ok and acc_src != "--config-file"
        print("  (missing: `accelerate launch` would use its defaults; write one with `hf-zero config`)")
    print(f"hf_zero config: {zero_path}  ({zero_src})")
    if zero_path.is_file():
        print(_indent(zero_path.read_text()))
        try:
            plugin = ZeroPlugin.from_yaml(zero_path)
            print(f"  effective: {_describe_plugin(plugin)}")
        except Exception as exc:  # ZeroConfigError, YAML errors
            ok = False
            print(f"  INVALID: {exc}")
    elif zero_src == f"${CONFIG_ENV}":
        ok = False
        print(f"  (missing: ${CONFIG_ENV} points here, so HfZeroAccelerator raises FileNotFoundError)")
    elif zero_src == "--zero-config-file":
        ok = False
        print("  (missing)")
    else:
        print("  (missing: HfZeroAccelerator uses the ZeroPlugin defaults)")
        print(f"  defaults: {_describe_plugin(ZeroPlugin())}")
    _print_reader_hint(zero_path)
    if acc_path.is_file():
        try:
            facts, problems = launch_plan(acc_path)
        except Exception as exc:
            ok = False
            print(f"`accelerate launch` would fail on this config: {type(exc).__name__}: {exc}")
        else:
            print(f"`accelerate launch{_cfg_flag(acc_path, args)} script.py` starts: " + "; ".join(facts))
            for p in problems:
                ok = False
                print(f"  PROBLEM: {p}")
    return 0 if ok else 1


def _cfg_flag(path: Path, args: argparse.Namespace) -> str:
    return f" --config_file {path}" if args.config_file else ""


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip("\n").splitlines())


def _describe_plugin(plugin: Any) -> str:
    return ", ".join(f"{k}={v}" for k, v in plugin.to_dict().items())


def _print_reader_hint(zero_path: Path) -> None:
    """Tell how the launched ranks will find hf_zero.yaml if it is not where they look by default."""
    from .plugin import CONFIG_ENV, default_config_path

    if os.environ.get(CONFIG_ENV):
        if Path(os.environ[CONFIG_ENV]).resolve() != zero_path.resolve():
            print(f"  note: ${CONFIG_ENV}={os.environ[CONFIG_ENV]} is set: HfZeroAccelerator reads that file, "
                  f"not this one")
        return
    if zero_path.resolve() != default_config_path().resolve():
        print(f"  note: HfZeroAccelerator reads {default_config_path()} by default: launch with "
              f"{CONFIG_ENV}={zero_path.resolve()}")


def _read_deepspeed(source: Any, mixed_precision: Optional[str]) -> Any:
    """read_deepspeed_config, its errors as usage errors (exit 2)."""
    from ..config import ZeroConfigError
    from ..deepspeed_config import read_deepspeed_config

    try:
        return read_deepspeed_config(source, mixed_precision=mixed_precision)
    except (ZeroConfigError, OSError) as exc:
        raise ConfigUsageError(str(exc)) from None


def _accelerate_deepspeed(ds: Dict[str, Any]) -> Any:
    """What the DeepSpeed answers of Accelerate's questionnaire say, as a DeepSpeed config: its config file if it
    names one, else its zero_stage / offload / accumulation / clipping answers in DeepSpeed's own keys."""
    if ds.get("deepspeed_config_file") not in (None, "", "none"):
        return ds["deepspeed_config_file"]
    zero: Dict[str, Any] = {}
    if ds.get("zero_stage") is not None:
        zero["stage"] = int(ds["zero_stage"])
    for src, dst in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        if ds.get(src) not in (None, ""):
            zero[dst] = {"device": ds[src]}
    data: Dict[str, Any] = {"zero_optimization": zero} if zero else {}
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if ds.get(key) is not None:
            data[key] = ds[key]
    return data


def _deepspeed_precision(settings: Any, accel: Any, args: argparse.Namespace) -> None:
    """The DeepSpeed file's own bf16/fp16 is the Accelerate precision (as under DeepSpeed, where the file's wins);
    a different one given on purpose is an error."""
    if "mixed_precision" not in settings.origin or settings.mixed_precision == accel.mixed_precision:
        return
    if args.mixed_precision is None and accel.mixed_precision in (None, "no"):
        print(f"mixed_precision set to {settings.mixed_precision} ({settings.origin['mixed_precision']} in "
              f"{settings.source}).")
        accel.mixed_precision = settings.mixed_precision
        return
    raise ConfigUsageError(f"{settings.source} says {settings.origin['mixed_precision']} but the Accelerate mixed "
                           f"precision is {accel.mixed_precision}: make them agree")


def write(args: argparse.Namespace) -> int:
    """Ask (or take from flags) and write both files; 0 when written."""
    from .plugin import ZeroPlugin
    from ..config import ZeroConfigError

    _check_flags(args)
    interactive = not args.yes
    machine = _machine()
    zero_defaults = {o.name: o.default for o in PLUGIN}
    acc_path, _ = _accelerate_path(args)
    zero_path, _ = _zero_path(args)

    if args.yes or any(getattr(args, f) is not None for f in _ACCELERATE_FLAGS):
        accel = _accelerate_from_flags(args, machine)
    else:
        accel = _ask_accelerate(zero_defaults)
    ds_notes: List[str] = []
    if args.from_deepspeed:
        _deepspeed_precision(_read_deepspeed(args.from_deepspeed, args.mixed_precision), accel, args)
        settings = _read_deepspeed(args.from_deepspeed, accel.mixed_precision)
        zero_defaults.update(settings.plugin_kwargs())
        ds_notes = settings.notes("hf-zero config")
    values = _ask_zero(args, zero_defaults, interactive, int(getattr(accel, "num_machines", 1) or 1))
    try:
        plugin = ZeroPlugin(**values)
    except ZeroConfigError as exc:
        raise ConfigUsageError(str(exc)) from None

    notes = _machine_notes(accel, machine)
    if plugin.activation_checkpointing == "partitioned":
        notes.append("activation_checkpointing 'partitioned' splits checkpoints across a model-parallel (tensor-"
                     "parallel) group; with pure data parallelism there is none and it runs as 'on' (said in the log)")

    acc_text = _accelerate_text(accel, acc_path)
    _write_atomic(acc_path, acc_text)
    plugin.to_yaml(zero_path)
    # read both back the way their consumers do: Accelerate's loader rejects unknown keys, ZeroPlugin validates
    from accelerate.commands.config.config_args import load_config_from_file

    load_config_from_file(str(acc_path))
    ZeroPlugin.from_yaml(zero_path)

    print(f"\nAccelerate config saved at {acc_path}")
    print(f"hf_zero config saved at {zero_path}")
    print(f"  {_describe_plugin(plugin)}")
    _print_reader_hint(zero_path)
    try:
        facts, problems = launch_plan(acc_path)
        print(f"`accelerate launch{_cfg_flag(acc_path, args)} script.py` starts: " + "; ".join(facts))
        notes.extend(p for p in problems if p not in notes)
    except Exception as exc:  # pragma: no cover - Accelerate internals changed
        notes.append(f"could not work out what `accelerate launch` starts: {type(exc).__name__}: {exc}")
    for note in notes:
        print(f"  NOTE: {note}")
    if ds_notes:
        print(f"  From the DeepSpeed config {args.from_deepspeed}, not taken as it is:")
        for line in ds_notes:
            print(f"    {line}")
    return 0


def run(args: argparse.Namespace) -> int:
    """`hf-zero config`: 0 written/shown fine, 1 aborted or --show found problems, 2 bad flags."""
    try:
        if args.show:
            return show(args)
        return write(args)
    except ConfigUsageError as exc:
        print(f"hf-zero config: error: {exc}", file=sys.stderr)
        return 2
    except ConfigAbort as exc:
        print(f"hf-zero config: {exc}", file=sys.stderr)
        return 1
    except EOFError:
        print("\nhf-zero config: input ended before every question was answered; nothing was written",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nhf-zero config: interrupted; nothing was written", file=sys.stderr)
        return 130
