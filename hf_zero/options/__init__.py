"""Every hf_zero option, declared once.

One `Option` holds all there is to say about a setting: its name (also its `hf_zero.yaml` key and, with dashes, its
`hf-zero config` flag), its default, the values it takes (a value kind: `Choice`, `Integer`, `Bytes`, `Number`,
`GroupSize`, `Flag`, `ClassNames`), its help text, what it needs of other options (`Requirement`) and the question
`hf-zero config` asks for it (`Question`). The kinds and ZeroConfigError live in kinds.py. From `OPTIONS`:

- `ZeroConfig` (hf_zero/config.py) gets its fields, defaults, docstring and validation (`declare`, `check_values`);
- `ZeroPlugin` (integrations/plugin.py) gets the same for every option with `plugin=True`, plus its own two
  (activation checkpointing), and `hf_zero.yaml` its keys;
- `hf-zero config` (integrations/config_cli.py) gets its flags, its questions in `Question.order`, and their parsers;
- the options table of docs/configuration.md is written by `python -m hf_zero.options --write` (a test compares
  the two).

To add an option, add one `Option` to `OPTIONS` and write the code that uses it. The kinds are small frozen
dataclasses, as PyTorch FSDP2 keeps its policies (torch/distributed/fsdp/_fully_shard/_fsdp_api.py).

This is the ground floor: it imports nothing from the rest of hf_zero (config.py imports it).
"""
from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

from .kinds import (Bytes, Choice, ClassNames, Flag, GroupSize, Integer, Kind, Number, Overrides, Reshard,
                    ZeroConfigError)

__all__ = ["OPTIONS", "BY_NAME", "ENGINE", "PLUGIN", "QUESTIONS", "Option", "Requirement", "Question", "Kind", "Choice",
           "Integer", "Bytes", "Number", "GroupSize", "Flag", "ClassNames", "Reshard", "Overrides", "ZeroConfigError",
           "check_values", "unmet", "asked", "declare", "args_doc", "markdown", "section_markers", "page_section",
           "replace_page_section",
           "HIERARCHICAL", "QUANTIZATION_BITS", "bits"]

# ------------------------------------------------------------------------------------------------ declarations
@dataclass(frozen=True)
class Requirement:
    """What an option needs of an earlier-declared one whenever it is not at its default: `other` in `allowed`, or,
    with `allowed=None`, `other` at its own default (the two exclude each other). `message` is a str.format template
    with {name}, {value}, {other} and {other_value}."""

    other: str
    allowed: Optional[Tuple[Any, ...]]
    message: str

    def met(self, other_value: Any, other_default: Any) -> bool:
        """Whether the other option's value (its default given) meets this requirement."""
        return other_value == other_default if self.allowed is None else other_value in self.allowed


@dataclass(frozen=True)
class Question:
    """`hf-zero config`'s question: the text, its place among the questions, and `only_if` (option, values): asked
    only when that option has one of these values (a requirement that is not met skips the question too)."""

    text: str
    order: int
    only_if: Optional[Tuple[str, Tuple[Any, ...]]] = None


@dataclass(frozen=True)
class Option:
    """One option. `engine`: a ZeroConfig field. `plugin`: a ZeroPlugin field, an hf_zero.yaml key and an
    `hf-zero config` flag. `label`: how questions and flag errors name it (default: the name with spaces)."""

    name: str
    default: Any
    kind: Kind
    help: str
    engine: bool = True
    plugin: bool = True
    label: Optional[str] = None
    question: Optional[Question] = None
    requires: Tuple[Requirement, ...] = ()

    @property
    def flag(self) -> str:
        """The `hf-zero config` flag."""
        return "--" + self.name.replace("_", "-")

    @property
    def yaml_key(self) -> str:
        """The key in hf_zero.yaml (under `zero:`)."""
        return self.name

    @property
    def words(self) -> str:
        """How questions and flag errors name the option."""
        return self.label or self.name.replace("_", " ")

    def check(self, value: Any) -> Any:
        """The value in its normal form, or ZeroConfigError naming this option."""
        return self.kind.check(self.name, value)

    def parse(self, text: str) -> Any:
        """A value from a flag or an answer (argparse.ArgumentTypeError when it is not one)."""
        return self.kind.parse(text, self.words)

    def field(self) -> Any:
        """The dataclass field `declare` gives the option (its Option in the field's metadata)."""
        return dataclasses.field(default=self.default, metadata={"option": self})


_DTYPE_CHOICE = Choice(("fp32", "compute"))
_OFFLOAD = Choice(("none", "cpu"), aliases=((None, "none"), (False, "none")))
QUANTIZATION_BITS = {"int8": 8, "int4": 4}  # the quantized options' values and their code widths (`bits`)
_QUANTIZED = Choice(("none",) + tuple(QUANTIZATION_BITS), aliases=((None, "none"), (False, "none")))
# `hierarchy`'s answers and the option each one sets to "host"
HIERARCHICAL = {"hsdp": "shard_group_size", "hpz": "hpz_partition_size"}

OPTIONS: Tuple[Option, ...] = (
    Option("stage", 2, Choice((0, 1, 2, 3), what="is not a ZeRO stage"),
           "0 (plain data parallel), 1 (partition optimizer states), 2 (+ gradients), 3 (+ parameters).",
           question=Question("ZeRO stage: 0 plain data parallel, 1 + optimizer states, 2 + gradients, 3 + parameters "
                             "(0/1/2/3)", 10)),
    Option("mixed_precision", "no",
           Choice(("no", "bf16", "fp16"), aliases=(("fp32", "no"),), what="is not a precision hf_zero trains in"),
           '"no" (train in the model\'s own dtypes), "bf16" or "fp16" (compute copies in that dtype, fp32 master '
           'weights and optimizer states inside the shard; fp16 adds dynamic loss scaling). Under Accelerate this is '
           'Accelerate\'s own `mixed_precision`, so it is no hf_zero.yaml key.', plugin=False),
    Option("grad_accum_dtype", "fp32", _DTYPE_CHOICE,
           '"fp32" accumulates gradients (full buffer at stages 0/1, shard at 2/3) in fp32; "compute" accumulates '
           'them in the compute dtype as the paper counts it (saves memory, loses precision with bf16).'),
    Option("reduce_dtype", None, Choice(("fp32", "compute"), none="the default: fp32 under mixed precision"),
           'The dtype stage-2/3 gradient buckets are reduce-scattered in: "fp32" or "compute" (the compute dtype; '
           'fp16 buckets are divided by the world size before the sum so it cannot overflow N times sooner). '
           'Default (None): "fp32" under fp16 and bf16 (a bf16 sum of N ranks loses bits: see docs/mixed_precision.md), the '
           'parameters\' own dtype otherwise. Stages 0/1 reduce their accumulator, in grad_accum_dtype.'),
    Option("reduce_bucket_size", 25 * 2**20, Bytes(),
           "Bytes per gradient bucket at stages 0-2 (C_B: constant, independent of model size).",
           question=Question("Reduce (gradient) bucket size in bytes", 60)),
    Option("allgather_bucket_size", 25 * 2**20, Bytes(), "Bytes per all-gather bucket after the step at stages 1-2.",
           label="all-gather bucket size", question=Question("All-gather bucket size in bytes", 70)),
    Option("prefetch", 1, Integer(0, "stage-3 units gathered ahead"),
           "Stage 3: how many units ahead to all-gather while the current one computes (0 disables).",
           question=Question("Prefetch: stage-3 units to all-gather ahead (integer >= 0)", 80,
                             only_if=("stage", (3,)))),
    Option("units", None, ClassNames(),
           "Module classes (or class names) whose instances are stage-3 units; default: the model's "
           "`_no_split_modules` (HF models), else every direct child of the first `nn.ModuleList`."),
    Option("offload_optimizer", "none", _OFFLOAD,
           '"none" or "cpu": keep fp32 master shards and optimizer states in CPU memory (and at stages 2/3 the '
           'gradient shards, copied there as each bucket is reduced), and step them there.',
           question=Question("Offload optimizer states and fp32 master weights to CPU memory? (none/cpu)", 20)),
    Option("offload_params", "none", _OFFLOAD, '"none" or "cpu" (stage 3 only): keep parameter shards in CPU memory.',
           question=Question("Offload parameter shards to CPU memory? (none/cpu)", 30),
           requires=(Requirement("stage", (3,), "{name}={value!r} needs stage 3 (parameters are only partitioned at "
                                 "stage 3); got stage={other_value}. Use stage=3 or offload_params='none'."),)),
    Option("activation_checkpointing", "off",
           Choice(("off", "on", "partitioned"), aliases=((None, "off"), (False, "off"), (True, "on"))),
           '"off", "on" (recompute each layer in the backward) or "partitioned" (P_a: split each checkpoint across '
           'the model-parallel group; with no such group it runs as "on" and says so). hf_zero installs it on every '
           'layer when the model is prepared.', engine=False,
           question=Question("Activation checkpointing? (off/on/partitioned)", 40)),
    Option("cpu_checkpointing", False, Flag(),
           "Keep activation checkpoints in CPU memory (P_a+cpu; pinned when training on a GPU).", engine=False,
           question=Question("Keep activation checkpoints in CPU memory (cpu checkpointing)? (yes/no)", 50),
           requires=(Requirement("activation_checkpointing", ("on", "partitioned"),
                                 "cpu_checkpointing=true keeps activation checkpoints in CPU memory, so it needs "
                                 "activation_checkpointing 'on' or 'partitioned'; got {other_value!r}"),)),
    Option("optimizer_is_elementwise", None, Flag(optional=True),
           "Declare an optimizer class hf_zero does not know to be element-wise (it then runs on 1-D segments of the "
           "shard); None means \"only the known element-wise torch optimizers\"."),
    Option("shard_group_size", None, GroupSize(),
           'Hierarchical partitioning (HSDP / MiCS), stages 1-3: partition over groups of K consecutive ranks (one '
           'host) and replicate across the N/K groups, so every all-gather and reduce-scatter stays inside a group '
           'and only the gradient shard\'s all-reduce crosses groups. K divides the world size; "host" takes the '
           'ranks per host (LOCAL_WORLD_SIZE). None, 1 or N: the plain stage.',
           requires=(Requirement("stage", (1, 2, 3),
                                 "{name}={value!r} needs stage 1-3 (stage 0 partitions nothing)"),)),
    Option("hpz_partition_size", None, GroupSize(),
           'ZeRO++ hpZ (stage 3): optimizer states and gradients stay partitioned over all N ranks; after a unit\'s '
           'forward all-gather each rank keeps a secondary shard of its parameters partitioned over its group of K '
           'ranks (one host), so the backward all-gather stays inside the host. Costs Ψ/K compute-dtype elements per '
           'rank. K or "host", as for shard_group_size; None, 1 or N: off.',
           requires=(
               Requirement("shard_group_size", None,
                           "shard_group_size={other_value!r} and {name}={value!r} are two ways of keeping all-gathers "
                           "inside a host; choose one (HSDP partitions K ways and replicates, hpZ keeps the N-way "
                           "partition and adds a K-way secondary copy of the parameters)"),
               Requirement("stage", (3,),
                           "{name}={value!r} needs stage 3 (it partitions the parameters a second time, and only stage "
                           "3 partitions them); got stage={other_value}. For stages 1-2 use shard_group_size, or drop "
                           "the option."),
           )),
    Option("collectives", "auto", Choice(("auto", "flat", "chunked")),
           'How all-gathers and reduce-scatters are issued: "flat" (one all_gather_into_tensor / '
           'reduce_scatter_tensor per bucket, as NCCL runs them), "chunked" (per-rank-chunk broadcasts, and a '
           'pairwise exchange of the chunks for a reduce-scatter: faster on gloo) or "auto" (chunked on gloo, flat otherwise).'),
    Option("debug_collectives", False, Flag(),
           "Before every collective, all-gather a fingerprint (kind, unit, size, call index) and raise with both "
           "sides' descriptions if ranks disagree, instead of hanging."),
    Option("initial_loss_scale", 2.0**16, Number(0), "fp16: the dynamic loss scale to start from."),
    Option("loss_scale_growth_interval", 2000, Integer(1, "clean fp16 steps before the loss scale grows"),
           "fp16: the scale grows by loss_scale_factor after this many steps without an overflow."),
    Option("loss_scale_factor", 2.0, Number(1),
           "fp16: the scale is divided by it on an overflow (the step is skipped) and multiplied by it to grow."),
    Option("min_loss_scale", 1.0, Number(0, inclusive=True), "fp16: the scale never drops below it."),
    # ZeRO++'s quantized communication (after the others: ZeroConfig's positional order stays)
    Option("quantized_weights", "none", _QUANTIZED,
           'ZeRO++ qwZ (stage 3): each rank block-quantizes its shard of a unit\'s parameters ("int8" or "int4", '
           'symmetric, one fp32 scale per quantization_block_size elements) and the ranks all-gather codes and scales '
           'instead of the compute dtype, forward and backward (with hpZ the backward\'s gather inside the host copies '
           'the already quantized values exactly). The fp32 master weights are never quantized. "none": off.',
           requires=(Requirement("stage", (3,), "{name}={value!r} quantizes the stage-3 parameter all-gather, so it "
                                 "needs stage 3; got stage={other_value}. Use stage=3 or quantized_weights='none'."),)),
    Option("quantized_gradients", "none", _QUANTIZED,
           'ZeRO++ qgZ (stages 2-3): each gradient bucket\'s chunks are block-quantized per destination rank, '
           'exchanged with all_to_all and dequantized and summed in fp32 by their owner, instead of a reduce-scatter '
           'in the reduce dtype ("int8" or "int4"; the paper uses int4). 1-D parameters and those smaller than a '
           'block (norms, biases) are reduced unquantized, as in DeepSpeed. "none": off.',
           requires=(Requirement("stage", (2, 3), "{name}={value!r} quantizes the per-micro-batch gradient "
                                 "reduce-scatter of stages 2-3; got stage={other_value}. Use stage 2 or 3, or "
                                 "quantized_gradients='none'."),)),
    Option("quantized_frozen_weights", "none", Choice(("none", "int8"), aliases=((None, "none"), (False, "none"))),
           'Stage 3 with a frozen base (LoRA): frozen parameter shards are kept as int8 codes plus one fp32 scale '
           'per quantization_block_size elements (4x less than fp32, 2x less than bf16 per rank, plus the scales) '
           'and all-gathered as codes; quantized once, when the model is sharded. The frozen values are then the '
           'dequantized ones everywhere: forward, full_state_dict, exports and checkpoints. "none": off.',
           requires=(Requirement("stage", (3,), "{name}={value!r} stores the partitioned frozen parameters "
                                 "quantized, so it needs stage 3; got stage={other_value}."),)),
    Option("quantization_block_size", 256, Integer(1, "elements per fp32 scale"),
           "Elements per quantization block (one fp32 scale each) of the quantized options: smaller blocks cost more "
           "scales and lose less."),
    Option("quantized_error_feedback", False, Flag(),
           "qgZ: keep each rank's quantization error of its gradient bucket and add it to the next micro-batch's "
           "gradient before quantizing (error feedback), so the error does not accumulate over steps.",
           requires=(Requirement("quantized_gradients", ("int8", "int4"), "{name}=True needs quantized_gradients "
                                 "'int8' or 'int4' (it corrects their quantization error); got {other_value!r}."),)),
    Option("hierarchy", "none", Choice(("none",) + tuple(HIERARCHICAL)),
           '`hf-zero config` on several machines: keep all-gathers inside each host. "hsdp" writes '
           'shard_group_size="host", "hpz" hpz_partition_size="host" (each with its own requirements); "none" the '
           'plain stage. Not a setting of its own: flags or keys for either option skip the question.',
           engine=False, plugin=False, label="hierarchical partitioning",
           question=Question("keep all-gathers inside each host? none, hsdp (partition per host, replicate across "
                             "hosts), hpz (stage 3: secondary per-host copy for the backward) (none/hsdp/hpz)", 90),
           requires=(Requirement("stage", (1, 2, 3), "{name}={value!r} needs stage 1-3 (stage 0 partitions "
                                 "nothing)"),)),
    Option("reshard_after_forward", "auto", Reshard(),
           'Stage 3: which units free their gathered parameters after the forward (FSDP2\'s policy of that name). '
           'true: every unit but the root (the paper\'s 3Ψ per step: each unit all-gathered for its forward and again '
           'for its backward); "auto": every unit but the root and the last one, whose backward comes right after its '
           'forward (torchtitan\'s default: saves that unit\'s second all-gather for holding it gathered meanwhile); '
           'false: none (2Ψ, all parameters gathered from forward to backward); K ranks: as true, but each rank keeps '
           'a secondary partition over its group of K (hpZ; the same as hpz_partition_size=K).',
           requires=(Requirement("stage", (3,), "{name}={value!r} is stage 3's policy (only stage 3 partitions the "
                                 "parameters); got stage={other_value}. Use stage=3 or drop the option."),)),
    Option("reshard_after_forward_modules", None, Overrides(),
           'Stage 3: per-unit exceptions to reshard_after_forward, as {name: true/false}, a name being a unit\'s '
           'qualified name (model.layers.3) or its class name (LlamaDecoderLayer); the qualified name wins. A name '
           'that matches no unit is an error when the model is sharded.',
           requires=(Requirement("stage", (3,), "{name} sets stage 3's reshard policy per unit; got "
                                 "stage={other_value}."),)),
    Option("async_save", False, Flag(),
           "Checkpoints (HfZeroAccelerator.save_state, ZeroTrainer's checkpoint-N) save in the background: the call "
           "returns once each rank's shard is copied to host memory, and the shard files are written and renamed "
           "into place on a thread while training goes on (save_checkpoint(async_save=True)); the next save, a load "
           "and the end of training wait for it. save_state(async_save=...) overrides it per call.", engine=False),
    Option("state_dict_timeout_s", 120.0, Number(0),
           "Stage 3: model.state_dict() and save_pretrained() gather the partitioned parameters, so every rank must "
           "call them (the full weights go to rank 0, the other ranks get meta tensors); a rank waits this many "
           "seconds for the others to call too, then raises an error naming the ranks that did not (a call on the "
           "main process only) instead of hanging."),
    Option("max_live_parameters", 10**9, Integer(0, "parameter elements; 0: no budget"),
           "Stage 3: the most parameter elements gathered at once by one unit. A unit (a layer, or the root: "
           "embeddings and head) with more is gathered by sub-module instead, recursively, so the largest thing "
           "gathered at once is this budget or the largest single module's own parameters; a unit is prefetched only "
           "when every gathered parameter, the prefetched unit's included, stays within it. DeepSpeed's "
           "stage3_max_live_parameters; 0: no budget."),
    Option("sequence_parallel_size", 1, Integer(1, "ranks per sequence-parallel group; 1: off"),
           "Ulysses sequence parallelism: ranks per sequence-parallel group (sp). The N ranks form N/sp data-parallel "
           "replicas; each sp group splits every sequence across its ranks and all-to-alls attention heads; ZeRO "
           "still partitions over all N ranks. 1 = off."),
    Option("tiled_loss_tokens", 0, Integer(0, "tokens per tile; 0: off"),
           "Tiled logits and loss (causal LMs given labels): the head and the cross-entropy run over tiles of this many "
           "tokens, recomputed in the backward, so the [sequence, vocab] logits never exist whole; outputs.logits then "
           "holds the last position's logits only (as logits_to_keep=1). 0 = off."),
    Option("tiled_mlp_tokens", 0, Integer(0, "tokens per tile; 0: off"),
           "Tiled MLP: each decoder layer's MLP and norms run over tiles of this many tokens, recomputed in the "
           "backward, so the MLP's [sequence, intermediate] activations and the norms' fp32 copies never exist whole. "
           "0 = off."),
)

BY_NAME: Dict[str, Option] = {o.name: o for o in OPTIONS}
ENGINE: Tuple[Option, ...] = tuple(o for o in OPTIONS if o.engine)
PLUGIN: Tuple[Option, ...] = tuple(o for o in OPTIONS if o.plugin)
QUESTIONS: Tuple[Option, ...] = tuple(sorted((o for o in PLUGIN if o.question), key=lambda o: o.question.order))


# ------------------------------------------------------------------------------------------------ using them
def check_values(values: Mapping[str, Any], options: Sequence[Option]) -> Dict[str, Any]:
    """Each option's value in normal form, in declaration order; each requirement is checked against the options
    before it. Raises ZeroConfigError naming the first option that is wrong."""
    out: Dict[str, Any] = {}
    for option in options:
        value = out[option.name] = option.check(values[option.name])
        if value == option.default:
            continue
        for req in option.requires:
            if req.other in out and not req.met(out[req.other], BY_NAME[req.other].default):
                raise ZeroConfigError(req.message.format(name=option.name, value=value, other=req.other,
                                                         other_value=out[req.other]), option.name)
    return out


def unmet(option: Option, values: Mapping[str, Any]) -> Optional[Requirement]:
    """The first requirement of `option` that `values` (which must hold the other options) do not meet."""
    return next((r for r in option.requires if r.other in values
                 and not r.met(values[r.other], BY_NAME[r.other].default)), None)


def bits(value: Any) -> int:
    """The code width of a quantized option's value: 8 for "int8", 4 for "int4", 0 for "none" (or None, False)."""
    return QUANTIZATION_BITS.get(_QUANTIZED.check("quantization", value), 0)


def args_doc(options: Sequence[Option], indent: int = 4) -> str:
    """A Google-style "Args:" section with every option's help."""
    pad = " " * indent
    lines = [f"{pad}Args:"]
    for o in options:
        lines.extend(textwrap.wrap(f"{o.name}: {o.help}", width=116, initial_indent=pad * 2,
                                   subsequent_indent=pad * 3))
    return "\n".join(lines) + "\n"


def declare(options: Sequence[Option]) -> Callable[[type], type]:
    """Class decorator: a dataclass whose first fields are `options` (in order, with their defaults), followed by
    the class's own annotated fields; the options' help is appended to the docstring."""

    def wrap(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        clash = sorted(set(own) & {o.name for o in options})
        if clash:
            raise TypeError(f"{cls.__name__} declares {clash} itself; they are declared in hf_zero.options")
        cls.__annotations__ = {**{o.name: o.kind.annotation for o in options}, **own}
        for o in options:
            setattr(cls, o.name, o.field())
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n" + args_doc(options)
        return dataclass(cls)

    return wrap


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(option: Option) -> str:
    value = option.kind.plain(option.default)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 2**20 and value % 2**20 == 0:
        return f"`{value}` ({value // 2**20} MiB)"
    return f"`{value}`" if value is not None else "`None`"


def markdown(options: Sequence[Option] = OPTIONS) -> str:
    """The options table of docs/configuration.md, one row per option."""
    rows = ["| option | default | allowed | in | what it does |", "|---|---|---|---|---|"]
    for o in options:
        where = ["ZeroConfig"] if o.engine else []
        if o.plugin:
            where.append(f"ZeroPlugin / yaml (`{o.flag}`{', asked' if o.question else ''})")
        elif o.question:
            where.append("`hf-zero config`'s question")
        rows.append(f"| `{o.name}` | {_default(o)} | {_cell(o.kind.allowed())} | {', '.join(where)} | "
                    f"{_cell(o.help)} |")
    return "\n".join(rows) + "\n"


def section_markers(name: str) -> Tuple[str, str]:
    """The comment lines a docs page puts around a generated table."""
    return (f"<!-- BEGIN {name} table (generated by `python -m hf_zero.options --write`) -->",
            f"<!-- END {name} table -->")


def page_section(text: str, name: str) -> str:
    """The generated table `name` as a page holds it (between its markers); ValueError if the markers are missing."""
    begin, end = section_markers(name)
    try:
        start = text.index(begin) + len(begin) + 1
        return text[start:text.index(end, start)]
    except ValueError:
        raise ValueError(f"no '{begin}' ... '{end}' section") from None


def replace_page_section(text: str, name: str, table: str) -> str:
    """`text` with the section `name` replaced by `table`."""
    old = page_section(text, name)
    begin, _ = section_markers(name)
    start = text.index(begin) + len(begin) + 1
    return text[:start] + table + text[start + len(old):]


def asked(option: Option, values: Mapping[str, Any]) -> bool:
    """Whether `hf-zero config` asks `option`'s question given the answers so far: not when its `only_if` or one
    of its requirements is not met."""
    cond = option.question.only_if if option.question else None
    if cond and values.get(cond[0]) not in cond[1]:
        return False
    return unmet(option, values) is None
