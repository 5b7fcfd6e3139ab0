"""One `Rule` per DeepSpeed key: set an hf_zero option (converted), go to the training loop, ask for what hf_zero does
anyway, or be named with the reason. `Reader` is the state of one read that the rules fill."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from ..options import BY_NAME, ZeroConfigError
from .settings import AUTO, DeepSpeedSettings, show_value

class Reader:
    """The state of one read: the settings being filled, the `mixed_precision` and `hidden_size` that resolve
    "auto", and the bf16 / fp16 `enabled` values seen."""

    def __init__(self, source: str, mixed_precision: Optional[str], hidden_size: Optional[int]) -> None:
        self.out = DeepSpeedSettings(source)
        self.requested = None if mixed_precision is None else BY_NAME["mixed_precision"].check(mixed_precision)
        self.hidden_size = hidden_size
        self.enabled: Dict[str, Any] = {}
        self.enabled_keys: Dict[str, str] = {}

    # ---- errors and records
    def error(self, key: str, value: Any, why: str, option: Optional[str] = None) -> ZeroConfigError:
        """The ZeroConfigError for a bad value: the file, the DeepSpeed key and value, and why."""
        return ZeroConfigError(f"{self.out.source}: {key}={show_value(value)} {why}", option)

    def set(self, option: str, value: Any, key: str, raw: Any) -> None:
        """Set hf_zero's `option` from DeepSpeed's `key` (its `raw` value), checked by the option's declaration."""
        try:
            self.out.values[option] = BY_NAME[option].check(value)
        except ZeroConfigError as exc:
            raise self.error(key, raw, f"(hf_zero's {option}): {exc}", option) from None
        self.out.origin[option] = key

    def ignore(self, key: str, value: Any, why: str) -> None:
        """Record a key hf_zero does not honour, for the warning."""
        self.out.not_honoured[f"{key}={show_value(value)}"] = why

    # ---- what other keys depend on
    @property
    def stage(self) -> int:
        """The file's stage so far (DeepSpeed's 0 when it sets none)."""
        return self.out.values.get("stage", 0)

    @property
    def precision(self) -> Optional[str]:
        """The precision DeepSpeed would train in (Accelerate's for "auto" / no section), None if unknown."""
        for dtype in ("bf16", "fp16"):
            if self.enabled.get(dtype) is True:
                return dtype
        if self.requested is None:
            return "no" if self.enabled and all(v is False for v in self.enabled.values()) else None
        if self.requested != "no" and self.enabled.get(self.requested) is False:
            return "no"  # Accelerate leaves an explicit false alone
        return self.requested

    @property
    def element_bytes(self) -> int:
        """Bytes per element of DeepSpeed's buckets: 2 under bf16/fp16, else 4."""
        return 2 if self.precision in ("bf16", "fp16") else 4

    @property
    def fp16_possible(self) -> bool:
        """Whether fp16 may be the precision (its loss-scale keys then matter)."""
        return self.precision in (None, "fp16") and self.enabled.get("fp16") is not False


# value readers: the DeepSpeed value in the form an option takes, or ZeroConfigError naming the key
def _whole(r: Reader, key: str, value: Any, minimum: int = 0) -> int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
    if not ok or value < minimum:
        raise r.error(key, value, f"must be a whole number >= {minimum}")
    return int(value)


def _number(r: Reader, key: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise r.error(key, value, "must be a number")
    return float(value)


def _flag(r: Reader, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise r.error(key, value, "must be true or false")
    return value


def _device(r: Reader, key: str, value: Any) -> str:
    if not isinstance(value, str) or value.lower() not in ("none", "cpu", "nvme"):
        raise r.error(key, value, "must be one of none, cpu, nvme (DeepSpeed's offload devices)")
    return value.lower()


def _elements(r: Reader, key: str, value: Any) -> int:
    return _whole(r, key, value, 1) * r.element_bytes


# ---------------------------------------------------------------------------------------------------- the rules
@dataclass(frozen=True)
class Rule:
    """What hf_zero does with one or more DeepSpeed keys (dotted paths). `section`: the key's whole subtree is one
    value. `apply(reader, key, value)` runs once per key the file sets, "auto" included."""

    keys: Tuple[str, ...]
    target: str
    how: str
    apply: Callable[[Reader, str, Any], None]
    section: bool = False


def _option(option: str, convert: Callable[[Reader, str, Any], Any],
            auto: Optional[Callable[[Reader], Any]] = None) -> Callable[[Reader, str, Any], None]:
    """Set `option` to convert(value); "auto" to auto(reader) (None: hf_zero's default)."""

    def apply(r: Reader, key: str, value: Any) -> None:
        converted = (auto(r) if auto else None) if value == AUTO else convert(r, key, value)
        if converted is not None:
            r.set(option, converted, key, value)

    return apply


def _builtin(expected: Any, why: str) -> Callable[[Reader, str, Any], None]:
    """hf_zero always does what `expected` asks; another value is named with `why`."""

    def apply(r: Reader, key: str, value: Any) -> None:
        if value != expected and value != AUTO:
            r.ignore(key, value, why)

    return apply


def _off(value: Any) -> bool:
    return value in (False, None, AUTO) or (isinstance(value, dict) and value.get("enabled") is False)


def _unsupported(why: str, off: Tuple[Any, ...] = (), fp16_only: bool = False) -> Callable[[Reader, str, Any], None]:
    """Not honoured: named with `why` unless the value asks for nothing (false, "auto", or one of `off`); with
    `fp16_only`, only when fp16 may be the precision."""

    def apply(r: Reader, key: str, value: Any) -> None:
        if _off(value) or value in off or (fp16_only and not r.fp16_possible):
            return
        r.ignore(key, value, why)

    return apply


def _no_effect(r: Reader, key: str, value: Any) -> None:
    if not _off(value):
        r.out.no_effect.append(f"{key}={show_value(value)}")


def _legacy_zero(r: Reader, key: str, value: Any) -> None:
    r.set("stage", 1 if _flag(r, key, value) else 0, key, value)


def _enabled(r: Reader, key: str, value: Any) -> None:
    if value != AUTO:
        _flag(r, key, value)
    dtype = key.split(".")[0]
    r.enabled[dtype], r.enabled_keys[dtype] = value, key
    if value == AUTO:
        r.out.auto_precision = True
    if r.enabled.get("bf16") is True and r.enabled.get("fp16") is True:
        raise ZeroConfigError(f"{r.out.source}: bf16.enabled and fp16.enabled are both true; DeepSpeed trains in one "
                              f"of them: set the other to false", "mixed_precision")


def _prefetch(r: Reader, key: str, value: Any) -> None:
    if value == AUTO:
        return
    elements = _whole(r, key, value)
    r.set("prefetch", 1 if elements else 0, key, value)
    if elements:
        r.ignore(key, value, "hf_zero prefetches whole stage-3 units (one layer each), not a number of elements: "
                             "prefetch=1 (raise ZeroConfig.prefetch to gather more units ahead)")


def _offload(option: str, stage3_only: bool) -> Callable[[Reader, str, Any], None]:
    def apply(r: Reader, key: str, value: Any) -> None:
        if value == AUTO:
            return
        if key.endswith("cpu_offload") or key.endswith("cpu_offload_param"):  # DeepSpeed's old flags
            device = "cpu" if _flag(r, key, value) else "none"
        else:
            device = _device(r, key, value)
        if stage3_only and r.stage != 3:
            if device != "none":
                r.ignore(key, value, f"DeepSpeed offloads parameters at stage 3 only; this file's stage is {r.stage}")
            return
        if device == "nvme":
            r.ignore(key, value, "hf_zero has no NVMe offload: offloading to CPU memory instead")
            device = "cpu"
        r.set(option, device, key, value)

    return apply


def _group(option: str, what: str, off: Tuple[int, ...]) -> Callable[[Reader, str, Any], None]:
    def apply(r: Reader, key: str, value: Any) -> None:
        if value == AUTO:
            return
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            return  # DeepSpeed's -1: off
        k = _whole(r, key, value)
        if k not in off:
            _at_stage_3(r, option, k, key, value, what)

    return apply


def _quantized(option: str, code: str, what: str) -> Callable[[Reader, str, Any], None]:
    """A ZeRO++ flag: true at stage 3 sets `option` to `code` (DeepSpeed's width); elsewhere DeepSpeed ignores it."""

    def apply(r: Reader, key: str, value: Any) -> None:
        if value != AUTO and _flag(r, key, value):
            _at_stage_3(r, option, code, key, value, what)

    return apply


def _at_stage_3(r: Reader, option: str, converted: Any, key: str, value: Any, what: str) -> None:
    """Set `option` from a key DeepSpeed reads at stage 3 only; at other stages name it."""
    if r.stage != 3:
        r.ignore(key, value, f"DeepSpeed uses {what} at stage 3 only; this file's stage is {r.stage}")
    else:
        r.set(option, converted, key, value)


def _dtype_choice(r: Reader, key: str, value: Any) -> Optional[str]:
    """fp32 -> "fp32"; the compute precision (bf16 / fp16) -> "compute"; another low precision is named."""
    if key == "fp32_allreduce":
        return "fp32" if _flag(r, key, value) else None
    name = str(value).lower()
    if name in ("fp32", "float32"):
        return "fp32"
    if name in ("fp16", "bf16", "float16", "bfloat16"):
        dtype = "bf16" if name.startswith("b") else "fp16"
        if r.precision == dtype:
            return "compute"
        training = r.precision or "an unknown precision"
        r.ignore(key, value, f"a {dtype} reduction/accumulation while training in {training}: hf_zero uses fp32 or the "
                             f"compute dtype")
        return None
    raise r.error(key, value, "must be one of fp32, fp16, bf16")


def _loss_scale(r: Reader, key: str, value: Any) -> None:
    if value == AUTO:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise r.error(key, value, "must be 0 (dynamic) or a positive loss scale")
    if value > 0:
        r.set("initial_loss_scale", float(value), key, value)
        if r.fp16_possible:
            r.ignore(key, value, "a fixed loss scale: hf_zero's scaler is dynamic; it starts at this value")


def _initial_scale_power(r: Reader, key: str, value: Any) -> None:
    if value != AUTO and "initial_loss_scale" not in r.out.values:  # a fixed loss_scale wins, as in DeepSpeed
        r.set("initial_loss_scale", 2.0 ** _whole(r, key, value), key, value)


def _partition_activations(r: Reader, key: str, value: Any) -> None:
    if value != AUTO and _flag(r, key, value):
        r.set("activation_checkpointing", "partitioned", key, value)


def _cpu_checkpointing(r: Reader, key: str, value: Any) -> None:
    if value != AUTO and _flag(r, key, value):
        r.set("cpu_checkpointing", True, key, value)
        if "activation_checkpointing" not in r.out.values:
            r.set("activation_checkpointing", "on", key, value)


def _accumulation(r: Reader, key: str, value: Any) -> None:
    if value != AUTO:
        r.out.gradient_accumulation_steps = _whole(r, key, value, 1)


def _clipping(r: Reader, key: str, value: Any) -> None:
    if value == AUTO:
        r.out.gradient_clipping = AUTO
    elif not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise r.error(key, value, "must be a number >= 0 (0: no clipping)")
    else:
        r.out.gradient_clipping = float(value) or None


def _micro_batch(r: Reader, key: str, value: Any) -> None:
    if value != AUTO:
        r.out.micro_batch_size = _whole(r, key, value, 1)


_ZERO = "zero_optimization."
_OFF_OPT, _OFF_PARAM = _ZERO + "offload_optimizer.", _ZERO + "offload_param."
_NO_EFFECT_KEYS = tuple(_ZERO + k for k in (
    "sub_group_size", "stage3_max_reuse_distance", "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold", "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "use_multi_rank_bucket_allreduce",
    "memory_efficient_linear", "round_robin_gradients", "log_trace_cache_warnings", "enable_sanity_checks",
    "pipeline_loading_checkpoint", "override_module_apply", "compute_grad_norm", "parameter_alignment",
    "save_muon_momentum_buffer_in_memory", "mics_hierarchical_params_gather", "cpu_offload_use_pin_memory",
)) + tuple(p + k for p in (_OFF_OPT, _OFF_PARAM) for k in (
    "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read", "pipeline_write", "fast_init",
    "cpuadam_cores_perc",
)) + ("bf16.immediate_grad_update", "zero_force_ds_cpu_optimizer", "steps_per_print", "wall_clock_breakdown",
      "dump_state", "memory_breakdown", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
      "flops_profiler", "timers", "aio", "checkpoint", "seq_parallel_communication_data_type",
      "activation_checkpointing.number_checkpoints", "activation_checkpointing.synchronize_checkpoint_boundary",
      "activation_checkpointing.profile")

RULES: Tuple[Rule, ...] = (
    Rule(("zero_optimization",), "`stage`", "DeepSpeed's old boolean form: true is stage 1, false stage 0",
         _legacy_zero),
    Rule((_ZERO + "stage",), "`stage`", 'the same stage; not set: DeepSpeed\'s 0; "auto": 2 (Accelerate\'s default)',
         _option("stage", lambda r, k, v: _whole(r, k, v), auto=lambda r: 2)),
    Rule(("bf16.enabled", "fp16.enabled"), "`mixed_precision` (ZeroConfig); Accelerate's `mixed_precision` under "
         "Accelerate", 'true: that precision (both true is an error); "auto" or no section: Accelerate\'s setting '
         '(`mixed_precision=` when reading); false: not that one. `bfloat16` is read as `bf16`', _enabled),
    Rule((_ZERO + "reduce_bucket_size",), "`reduce_bucket_size`",
         "elements x bytes per element (2 under bf16/fp16, else 4): DeepSpeed counts elements, hf_zero bytes; "
         '"auto": hidden_size² elements with `hidden_size=` (as Accelerate fills it), else hf_zero\'s default',
         _option("reduce_bucket_size", _elements,
                 auto=lambda r: r.hidden_size ** 2 * r.element_bytes if r.hidden_size else None)),
    Rule((_ZERO + "allgather_bucket_size", "allgather_size"), "`allgather_bucket_size`",
         "elements x bytes per element, as reduce_bucket_size (`allgather_size`: with the old boolean "
         "zero_optimization)", _option("allgather_bucket_size", _elements)),
    Rule((_ZERO + "stage3_prefetch_bucket_size",), "`prefetch`",
         '0: 0; more: 1 unit (hf_zero prefetches whole units, named in the warning); "auto": hf_zero\'s default 1',
         _prefetch),
    Rule((_ZERO + "stage3_max_live_parameters",), "`max_live_parameters`",
         'the same number of parameter elements; "auto": hf_zero\'s default (1e9, DeepSpeed\'s too)',
         _option("max_live_parameters", lambda r, k, v: _whole(r, k, v))),
    Rule(("sequence_parallel_size",), "`sequence_parallel_size`",
         'the same number of ranks per sequence-parallel group (DeepSpeed-Ulysses; 1: off); "auto": hf_zero\'s '
         "default 1", _option("sequence_parallel_size", lambda r, k, v: _whole(r, k, v, 1))),
    Rule((_OFF_OPT + "device", _ZERO + "cpu_offload"), "`offload_optimizer`",
         "none/cpu: the same; nvme: cpu, named in the warning (no NVMe offload); cpu_offload (DeepSpeed's old flag) "
         "true: cpu", _offload("offload_optimizer", stage3_only=False)),
    Rule((_OFF_PARAM + "device", _ZERO + "cpu_offload_param"), "`offload_params`",
         "the same at stage 3 (nvme: cpu, named); at stages 0-2 DeepSpeed does not offload parameters: named",
         _offload("offload_params", stage3_only=True)),
    Rule((_ZERO + "zero_hpz_partition_size",), "`hpz_partition_size`",
         "K > 1 at stage 3: K (ZeRO++ hpZ); 0 or 1: off; at stages 0-2 DeepSpeed ignores it: named",
         _group("hpz_partition_size", "hpZ", (0, 1))),
    Rule((_ZERO + "mics_shard_size",), "`shard_group_size`",
         "K > 0 at stage 3: K (MiCS partitions within groups of K ranks and replicates across them, as HSDP does; "
         "DeepSpeed 0.19 removed it, older configs have it); -1: off; at stages 0-2 DeepSpeed ignored it: named",
         _group("shard_group_size", "MiCS", (0,))),
    Rule(("communication_data_type", "fp32_allreduce"), "`reduce_dtype`",
         'fp32 (or fp32_allreduce: true): "fp32"; the training precision (bf16/fp16): "compute"; another: named',
         _option("reduce_dtype", _dtype_choice)),
    Rule(("data_types.grad_accum_dtype",), "`grad_accum_dtype`",
         'fp32: "fp32"; the training precision: "compute"; another: named', _option("grad_accum_dtype", _dtype_choice)),
    Rule(("fp16.loss_scale",), "`initial_loss_scale`",
         "0: dynamic scaling, as hf_zero's; S > 0 (a fixed scale): starts at S but stays dynamic, named",
         _loss_scale),
    Rule(("fp16.initial_scale_power",), "`initial_loss_scale`", "2 ** power", _initial_scale_power),
    Rule(("fp16.loss_scale_window",), "`loss_scale_growth_interval`", "the same (clean steps before the scale grows)",
         _option("loss_scale_growth_interval", lambda r, k, v: _whole(r, k, v, 1))),
    Rule(("fp16.min_loss_scale",), "`min_loss_scale`", "the same",
         _option("min_loss_scale", lambda r, k, v: _number(r, k, v))),
    Rule(("activation_checkpointing.partition_activations",), "`activation_checkpointing` (ZeroPlugin)",
         'true: "partitioned" (P_a; hf_zero checkpoints every layer, where DeepSpeed configures the checkpoints the '
         'model makes)', _partition_activations),
    Rule(("activation_checkpointing.cpu_checkpointing",), "`cpu_checkpointing` (ZeroPlugin)",
         'true: true, and activation_checkpointing "on" unless partitioned', _cpu_checkpointing),
    Rule(("gradient_accumulation_steps",), "HfZeroAccelerator / TrainingArguments `gradient_accumulation_steps`",
         'not an engine option: `accelerator_kwargs()` / `training_arguments()` carry it; "auto": Accelerate\'s / '
         "the Trainer's own", _accumulation),
    Rule(("gradient_clipping",), "`clip_grad_norm_(max_norm)` / TrainingArguments `max_grad_norm`",
         'the norm to clip at (not set or 0: DeepSpeed clips nothing); "auto": Accelerate\'s 1.0, the Trainer\'s '
         "max_grad_norm", _clipping),
    Rule(("train_micro_batch_size_per_gpu",), "the DataLoader's batch size (TrainingArguments "
         "`per_device_train_batch_size`)", '"auto": the DataLoader\'s', _micro_batch),
    Rule(("train_batch_size",), "-", "micro batch x accumulation x ranks, checked by DeepSpeed; hf_zero takes the "
         "DataLoader's batch: named unless \"auto\"",
         _unsupported("hf_zero takes the batch from your DataLoader (TrainingArguments.per_device_train_batch_size); "
                      "this total is micro batch x accumulation steps x ranks")),
    Rule((_ZERO + "contiguous_gradients",), "(always)",
         "true: hf_zero's flat buffers are contiguous (M_D); false: named",
         _builtin(True, "hf_zero always keeps gradients in contiguous flat buffers (M_D)")),
    Rule((_ZERO + "overlap_comm",), "(always)", "true: hf_zero reduces while the backward runs; false: named",
         _builtin(True, "hf_zero always overlaps gradient reduction with the backward")),
    Rule((_ZERO + "reduce_scatter", _ZERO + "allgather_partitions"), "(always)",
         "true: hf_zero reduce-scatters gradients and all-gathers partitions; false (DeepSpeed's all-reduce / "
         "broadcast variants): named", _builtin(True, "hf_zero always reduce-scatters gradients and all-gathers the "
                                                      "partitions (same result, the paper's communication)")),
    Rule((_ZERO + "ignore_unused_parameters",), "(always)", "true: hf_zero reduces zeros for parameters without a "
         "gradient; false: named", _builtin(True, "hf_zero never raises on parameters without a gradient: it "
                                                 "reduces zeros for them (DDP's find_unused_parameters)")),
    Rule((_ZERO + "load_from_fp32_weights",), "(always)", "true: checkpoints restore the fp32 master; false: named",
         _builtin(True, "hf_zero checkpoints always restore the fp32 master weights")),
    Rule((_ZERO + "stage3_gather_16bit_weights_on_model_save", _ZERO + "stage3_gather_fp16_weights_on_model_save"),
         "(always)", "true: save_model / get_state_dict gather full weights; false: named",
         _builtin(True, "hf_zero's save_model / get_state_dict always gather the full weights")),
    Rule((_OFF_OPT + "pin_memory", _OFF_PARAM + "pin_memory"), "(always)",
         "true: offloaded shards are pinned when training on a GPU; false: named",
         _builtin(True, "hf_zero pins offloaded shards whenever it trains on a GPU")),
    Rule(("zero_allow_untested_optimizer",), "(always)", "hf_zero runs any element-wise torch optimizer "
         "(`optimizer_is_elementwise` for others)", _builtin(True, "hf_zero runs any element-wise torch optimizer")),
    Rule((_ZERO + "zero_quantized_weights",), "`quantized_weights`",
         'true at stage 3: "int8" (ZeRO++ qwZ, DeepSpeed\'s int8 weight all-gather); at stages 0-2 DeepSpeed '
         'ignores it: named', _quantized("quantized_weights", "int8", "qwZ")),
    Rule((_ZERO + "zero_quantized_nontrainable_weights",), "`quantized_frozen_weights`",
         'true at stage 3: "int8" (frozen parameters kept and all-gathered as int8); at stages 0-2 named',
         _quantized("quantized_frozen_weights", "int8", "quantized frozen weights")),
    Rule((_ZERO + "zero_quantized_gradients",), "`quantized_gradients`",
         'true at stage 3: "int4" (ZeRO++ qgZ, DeepSpeed\'s int4 all-to-all gradient reduction); at stages 0-2 '
         'DeepSpeed ignores it: named (hf_zero also runs qgZ at stage 2: set quantized_gradients there yourself)',
         _quantized("quantized_gradients", "int4", "qgZ")),
    Rule((_OFF_OPT + "ratio",), "-", "partial offload: named when < 1",
         _unsupported("hf_zero offloads all of the optimizer state or none of it", off=(1, 1.0))),
    Rule((_OFF_OPT + "super_offload",), "-", "named when true",
         _unsupported("SuperOffload is DeepSpeed's; hf_zero steps offloaded shards with torch's CPU kernels")),
    Rule(("fp16.hysteresis",), "-", "named unless 1 (while fp16 may be the precision)",
         _unsupported("hf_zero's loss scaler lowers the scale on the first overflow (hysteresis 1)", off=(1,),
                      fp16_only=True)),
    Rule(("fp16.consecutive_hysteresis",), "-", "named when true (while fp16 may be the precision)",
         _unsupported("hf_zero's loss scaler has no hysteresis", fp16_only=True)),
    Rule(("fp16.auto_cast",), "-", "named when true (while fp16 may be the precision)",
         _unsupported("hf_zero casts the parameters, not the inputs: floating-point inputs keep their dtype",
                      fp16_only=True)),
    Rule(("fp16.fp16_master_weights_and_grads", "bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states"),
         "-", "named when true", _unsupported("hf_zero keeps fp32 master weights and optimizer states in the shard")),
    Rule(("bf16.check_grad_overflow",), "-", "named when true",
         _unsupported("hf_zero checks for overflow under fp16 only")),
    Rule(("optimizer",), "-", "named: hf_zero steps the torch optimizer the script (or the Trainer) builds",
         _unsupported("hf_zero steps the torch optimizer your script builds (e.g. torch.optim.AdamW(params, lr=...)) "
                      "or the Trainer builds from TrainingArguments; DeepSpeed's optimizer section is not read"),
         section=True),
    Rule(("scheduler",), "-", "named: the script's (or the Trainer's) scheduler",
         _unsupported("the learning-rate scheduler is your script's or the Trainer's (lr_scheduler_type); "
                      "DeepSpeed's scheduler section is not read"), section=True),
    Rule(("prescale_gradients", "gradient_predivide_factor"), "-", "named when set",
         _unsupported("hf_zero divides by N after the sum (fp32 buckets under mixed precision; fp16 buckets are "
                      "divided before it)", off=(1, 1.0))),
    Rule(("sparse_gradients",), "-", "named when true", _unsupported("sparse embedding gradients are not supported")),
    Rule(("amp",), "-", "named when enabled",
         _unsupported("apex AMP is not used: hf_zero's mixed_precision (bf16/fp16 compute, fp32 master)"),
         section=True),
    Rule((_ZERO + "legacy_stage1", _ZERO + "elastic_checkpoint"), "-", "named when true",
         _unsupported("a DeepSpeed-only stage-1 / checkpoint variant")),
    Rule((_ZERO + "zeropp_loco_param",), "-", "named", _unsupported(
        "LoCo (error feedback for ZeRO++ qgZ) is not implemented"), section=True),
    Rule((_ZERO + "leaf_module",), "-", "named: choose stage-3 units with `units`", _unsupported(
        "DeepSpeed's leaf modules are not read: hf_zero gathers whole units; choose them with ZeroConfig.units"),
        section=True),
    Rule((_ZERO + "zenflow",), "-", "named", _unsupported("ZenFlow is DeepSpeed's"), section=True),
    Rule(("activation_checkpointing.contiguous_memory_optimization",), "-", "named when true",
         _unsupported("hf_zero keeps each checkpoint as its own tensor")),
    Rule(("tensor_parallel", "pipeline", "compression_training", "data_efficiency",
          "curriculum_learning", "elasticity", "autotuning", "sparse_attention", "msamp", "fp8", "moe", "eigenvalue",
          "progressive_layer_drop", "graph_harvesting"), "-",
         "other DeepSpeed features: named",
         _unsupported("a DeepSpeed feature outside ZeRO that hf_zero does not implement", off=(1,)), section=True),
    Rule(_NO_EFFECT_KEYS, "-", "DeepSpeed tuning and logging knobs with no counterpart: named together, as having no "
         "effect", _no_effect, section=True),
)
RULE_OF: Dict[str, Rule] = {k: rule for rule in RULES for k in rule.keys}
