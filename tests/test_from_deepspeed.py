"""A DeepSpeed user brings their config: `ZeroConfig.from_deepspeed`, `ZeroPlugin.from_deepspeed` and
`read_deepspeed_config` on the configs of DeepSpeed's own documentation and tutorials and of the Transformers
DeepSpeed guide, written here as data, checked field by field against what each DeepSpeed key means; the one
warning naming every key that is not honoured; "auto" as Accelerate resolves it; bad values naming the key.

Sources (as published): DeepSpeed docs/_tutorials/zero.md (ZeRO-1, ZeRO-2, ZeRO-Infinity), zero-offload.md,
zeropp.md, getting-started.md, docs/_pages/config-json.md (fp16, activation checkpointing), the MiCS section of
DeepSpeed's ZeRO-3 docs, and Transformers' deepspeed guide (ds_config_zero2.json, ds_config_zero3.json).
No process group; one test imports DeepSpeed's own config parser to check the reading of its keys.
"""
from __future__ import annotations

import json
import warnings

import pytest

from hf_zero import ZeroConfig, ZeroPlugin
from hf_zero.config import ZeroConfigError
from hf_zero.deepspeed_config import RULES, DeepSpeedConfigWarning, markdown, read_deepspeed_config
from hf_zero.options import BY_NAME, page_section

from test_options import ROOT

MiB = 2**20
DEFAULTS = ZeroConfig()

ZERO1_TUTORIAL = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}
ZERO2_TUTORIAL = {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": True,
                                        "reduce_scatter": True, "reduce_bucket_size": 5e8,
                                        "allgather_bucket_size": 5e8}}
ZERO_INFINITY_TUTORIAL = {"zero_optimization": {
    "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
    "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
    "sub_group_size": 1e9, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
ZERO_OFFLOAD_TUTORIAL = {"zero_optimization": {"stage": 2, "cpu_offload": True, "contiguous_gradients": True,
                                               "overlap_comm": True}}
ZEROPP_TUTORIAL = {"zero_optimization": {
    "stage": 3, "reduce_bucket_size": 10000000, "reduce_scatter": False, "zero_quantized_weights": True,
    "zero_hpz_partition_size": 16, "zero_quantized_gradients": True, "contiguous_gradients": True,
    "overlap_comm": True}}
GETTING_STARTED = {"train_batch_size": 8, "gradient_accumulation_steps": 1,
                   "optimizer": {"type": "Adam", "params": {"lr": 0.00015}}, "fp16": {"enabled": True},
                   "zero_optimization": True}
CONFIG_JSON_FP16 = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 32, "loss_scale_window": 1000,
                             "hysteresis": 2, "min_loss_scale": 1}}
CONFIG_JSON_ACTIVATION_CHECKPOINTING = {"activation_checkpointing": {
    "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
    "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}}
MICS = {"zero_optimization": {"stage": 3, "mics_shard_size": 8, "mics_hierarchical_params_gather": True}}
# Transformers' ds_config_zero2.json and ds_config_zero3.json: the same around different zero_optimization sections
_HF_COMMON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
HF_ZERO2 = {**_HF_COMMON, "zero_optimization": {
    "stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "allgather_partitions": True,
    "allgather_bucket_size": 2e8, "overlap_comm": True, "reduce_scatter": True, "reduce_bucket_size": 2e8,
    "contiguous_gradients": True}}
HF_ZERO3 = {**_HF_COMMON, "zero_optimization": {
    "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
    "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
    "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": True}}


def _read(config, **kwargs):
    """ZeroConfig.from_deepspeed, and the warnings it gave (at most one DeepSpeedConfigWarning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = ZeroConfig.from_deepspeed(config, **kwargs)
    ours = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(ours) <= 1, [str(w.message) for w in ours]
    return result, str(ours[0].message) if ours else ""


def _only(config: ZeroConfig, **fields) -> None:
    """`config` has these fields and hf_zero's defaults everywhere else."""
    for name, default in DEFAULTS.to_dict().items():
        assert getattr(config, name) == fields.get(name, default), (name, getattr(config, name))


# ------------------------------------------------------------------------------------------------ DeepSpeed's docs
def test_zero1_tutorial():
    config, warning = _read(ZERO1_TUTORIAL)
    _only(config, stage=1, reduce_bucket_size=5 * 10**8 * 4)  # 5e8 elements of fp32 (no fp16/bf16 section)
    assert warning == ""


def test_zero2_tutorial():
    config, warning = _read(ZERO2_TUTORIAL)
    _only(config, stage=2, reduce_bucket_size=2 * 10**9, allgather_bucket_size=2 * 10**9)
    assert warning == ""  # contiguous_gradients, overlap_comm, reduce_scatter: what hf_zero always does
    bf16, _ = _read(ZERO2_TUTORIAL, mixed_precision="bf16")  # "no section" = Accelerate's precision
    _only(bf16, stage=2, mixed_precision="bf16", reduce_bucket_size=10**9, allgather_bucket_size=10**9)


def test_zero_infinity_tutorial_cpu_offload():
    config, warning = _read(ZERO_INFINITY_TUTORIAL)
    _only(config, stage=3, reduce_bucket_size=10**7 * 4, offload_optimizer="cpu", offload_params="cpu", prefetch=1)
    assert "stage3_prefetch_bucket_size=10000000: hf_zero prefetches whole stage-3 units" in warning
    for knob in ("stage3_max_reuse_distance=1000000000",
                 "stage3_param_persistence_threshold=100000", "sub_group_size=1000000000"):
        assert knob in warning.split("no effect")[1], knob


def test_max_live_parameters_is_the_live_parameter_budget():
    """stage3_max_live_parameters is hf_zero's max_live_parameters, in the same unit (parameter elements); the
    tutorial's 1e9 is the default and sets nothing, "auto" keeps the default."""
    config, warning = _read({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 3e8}})
    _only(config, stage=3, max_live_parameters=3 * 10**8)
    assert "stage3_max_live_parameters" not in warning
    config, _ = _read({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"}})
    _only(config, stage=3)


def test_sequence_parallel_size_is_the_ulysses_group():
    """DeepSpeed's top-level sequence_parallel_size (DeepSpeed-Ulysses: ranks per sequence-parallel group) is
    hf_zero's option of that name, at any stage; 1 and "auto" keep the default (off); below 1 names the key."""
    config, warning = _read({"zero_optimization": {"stage": 3}, "sequence_parallel_size": 2})
    _only(config, stage=3, sequence_parallel_size=2)
    assert "sequence_parallel_size" not in warning
    config, warning = _read({"zero_optimization": {"stage": 1}, "sequence_parallel_size": 4.0})
    _only(config, stage=1, sequence_parallel_size=4)
    assert warning == ""
    for value in (1, "auto"):
        config, warning = _read({"zero_optimization": {"stage": 2}, "sequence_parallel_size": value})
        _only(config, stage=2)
        assert warning == ""
    assert ZeroPlugin.from_deepspeed({"sequence_parallel_size": 2}).sequence_parallel_size == 2
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ZeroConfigError, match=r"sequence_parallel_size=\S+ must be a whole number >= 1"):
            ZeroConfig.from_deepspeed({"sequence_parallel_size": bad})


def test_zero_offload_tutorial_old_cpu_offload_flag():
    config, warning = _read(ZERO_OFFLOAD_TUTORIAL)
    _only(config, stage=2, offload_optimizer="cpu")
    assert warning == ""


def test_zeropp_tutorial():
    config, warning = _read(ZEROPP_TUTORIAL)
    # ZeRO++'s three: hpZ, qwZ as DeepSpeed's int8 weight all-gather, qgZ as its int4 gradient all-to-all
    _only(config, stage=3, reduce_bucket_size=10**7 * 4, hpz_partition_size=16, quantized_weights="int8",
          quantized_gradients="int4")
    lines = warning.splitlines()
    assert lines[0].startswith("hf_zero read the DeepSpeed config (DeepSpeed config dict)")
    named = [line for line in lines if line.startswith("  - ")]
    assert len(named) == 1, warning  # exactly the keys it cannot honour, each with its reason
    assert any("reduce_scatter=false: hf_zero always reduce-scatters" in line for line in named)


def test_zeropp_flags_outside_stage_3_are_named_as_deepspeed_ignores_them():
    """DeepSpeed reads zero_quantized_* at stage 3 only: at stage 2 they set nothing here and are named."""
    config, warning = _read({"zero_optimization": {"stage": 2, "zero_quantized_weights": True,
                                                   "zero_quantized_gradients": True,
                                                   "zero_quantized_nontrainable_weights": True}})
    _only(config, stage=2)
    for key, what in (("zero_quantized_weights", "qwZ"), ("zero_quantized_gradients", "qgZ"),
                      ("zero_quantized_nontrainable_weights", "quantized frozen weights")):
        assert f"{key}=true: DeepSpeed uses {what} at stage 3 only; this file's stage is 2" in warning, warning
    frozen, warning = _read({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True,
                                                   "zero_quantized_weights": False}})
    _only(frozen, stage=3, quantized_frozen_weights="int8")
    assert warning == ""


def test_getting_started_old_boolean_zero_and_fp16():
    config, warning = _read(GETTING_STARTED)
    _only(config, stage=1, mixed_precision="fp16")
    assert 'optimizer={"type":"Adam"' in warning and "torch optimizer your script builds" in warning
    assert "train_batch_size=8: hf_zero takes the batch from your DataLoader" in warning
    assert "gradient_accumulation_steps" not in warning  # 1 is what every loop does
    settings = read_deepspeed_config(GETTING_STARTED)
    assert settings.gradient_accumulation_steps == 1 and settings.accelerator_kwargs() == {
        "gradient_accumulation_steps": 1, "mixed_precision": "fp16"}


def test_config_json_fp16_loss_scale():
    config, warning = _read(CONFIG_JSON_FP16)
    _only(config, stage=0, mixed_precision="fp16", initial_loss_scale=2.0**32, loss_scale_growth_interval=1000,
          min_loss_scale=1.0)  # no zero_optimization: DeepSpeed's stage 0
    assert "fp16.hysteresis=2: hf_zero's loss scaler lowers the scale on the first overflow" in warning
    fixed, warning = _read({"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 16}})
    assert fixed.initial_loss_scale == 128.0 and "fp16.loss_scale=128: a fixed loss scale" in warning


def test_config_json_activation_checkpointing():
    settings = read_deepspeed_config(CONFIG_JSON_ACTIVATION_CHECKPOINTING)
    assert settings.values == {"stage": 0} and settings.not_honoured == {} and settings.no_effect == []
    plugin = ZeroPlugin.from_deepspeed({"zero_optimization": {"stage": 2}, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": True}})
    assert (plugin.stage, plugin.activation_checkpointing, plugin.cpu_checkpointing) == (2, "partitioned", True)
    cpu_only = ZeroPlugin.from_deepspeed({"activation_checkpointing": {"cpu_checkpointing": True}})
    assert (cpu_only.activation_checkpointing, cpu_only.cpu_checkpointing) == ("on", True)
    config, warning = _read({"activation_checkpointing": {"partition_activations": True}})
    assert "activation_checkpointing.partition_activations: ZeroPlugin(activation_checkpointing='partitioned')" \
           in warning  # not an engine option: said where it goes


def test_mics_is_hierarchical_partitioning():
    config, warning = _read(MICS)
    _only(config, stage=3, shard_group_size=8)
    assert "mics_hierarchical_params_gather=true" in warning.split("no effect")[1]
    config, warning = _read({"zero_optimization": {"stage": 2, "mics_shard_size": 8}})
    _only(config, stage=2)
    assert "mics_shard_size=8: DeepSpeed uses MiCS at stage 3 only" in warning


# ------------------------------------------------------------------------------------------------ Transformers' guide
def test_transformers_zero2_with_auto_values():
    config, warning = _read(HF_ZERO2)
    _only(config, stage=2, offload_optimizer="cpu", reduce_bucket_size=2 * 10**8 * 4,
          allgather_bucket_size=2 * 10**8 * 4, loss_scale_growth_interval=1000, min_loss_scale=1.0)
    assert "fp16.hysteresis=2" in warning  # fp16 "auto": it may be the precision
    assert "optimizer=" in warning and "scheduler=" in warning and "steps_per_print=2000" in warning
    assert "gradient_clipping='auto'" in warning and "no mixed_precision= given" in warning
    for auto in ("train_batch_size", "train_micro_batch_size_per_gpu", "wall_clock_breakdown"):
        assert auto not in warning  # "auto" / false: nothing asked of hf_zero
    bf16, warning = _read(HF_ZERO2, mixed_precision="bf16")  # Accelerate's bf16 resolves fp16 "auto" to off
    _only(bf16, stage=2, mixed_precision="bf16", offload_optimizer="cpu", reduce_bucket_size=2 * 10**8 * 2,
          allgather_bucket_size=2 * 10**8 * 2, loss_scale_growth_interval=1000, min_loss_scale=1.0)
    assert "hysteresis" not in warning
    fp16, _ = _read(HF_ZERO2, mixed_precision="fp16")
    assert fp16.mixed_precision == "fp16"


def test_transformers_zero3_with_auto_buckets_from_hidden_size():
    config, warning = _read(HF_ZERO3, mixed_precision="bf16", hidden_size=768)
    _only(config, stage=3, mixed_precision="bf16", offload_optimizer="cpu", offload_params="cpu",
          reduce_bucket_size=768 * 768 * 2, loss_scale_growth_interval=1000, min_loss_scale=1.0)
    assert "stage3_prefetch_bucket_size" not in warning  # "auto": hf_zero's own prefetch
    assert "stage3_gather_16bit_weights_on_model_save" not in warning  # hf_zero always gathers on save
    without, _ = _read(HF_ZERO3, mixed_precision="bf16")
    assert without.reduce_bucket_size == DEFAULTS.reduce_bucket_size  # no hidden size: hf_zero's default


def test_training_loop_settings_go_to_the_accelerator_and_the_trainer():
    ds = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "gradient_accumulation_steps": 4,
          "gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8}
    settings = read_deepspeed_config(ds)
    assert settings.accelerator_kwargs() == {"gradient_accumulation_steps": 4, "mixed_precision": "bf16"}
    assert settings.training_arguments() == {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
                                             "max_grad_norm": 1.0, "bf16": True}
    assert settings.max_grad_norm == 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = ZeroPlugin.from_deepspeed(ds)
    assert plugin.stage == 2 and plugin.to_zero_config("bf16").reduce_bucket_size == DEFAULTS.reduce_bucket_size
    (warning,) = [str(w.message) for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    for where in ("HfZeroAccelerator(gradient_accumulation_steps=4)", "clip_grad_norm_(model.parameters(), 1.0)",
                  "per_device_train_batch_size=8", "HfZeroAccelerator(mixed_precision='bf16')"):
        assert where in warning, where
    unset = read_deepspeed_config({"gradient_clipping": "auto"})
    assert unset.max_grad_norm == 1.0 and "max_grad_norm" not in unset.training_arguments()  # the Trainer's own
    assert read_deepspeed_config({}).training_arguments() == {"max_grad_norm": 0.0}  # DeepSpeed would not clip


def test_nvme_offload_and_unknown_keys_are_named_not_dropped(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                                     "nvme_path": "/nvme"},
                                                      "offload_optimizer": {"device": "nvme"},
                                                      "some_new_knob": 3}, "my_key": True}))
    config, warning = _read(path)
    _only(config, stage=3, offload_optimizer="cpu", offload_params="cpu")
    assert str(path) in warning
    assert 'offload_param.device="nvme": hf_zero has no NVMe offload: offloading to CPU memory instead' in warning
    assert 'offload_optimizer.device="nvme"' in warning
    assert "zero_optimization.some_new_knob=3: not a DeepSpeed key hf_zero knows" in warning
    assert "my_key=true: not a DeepSpeed key hf_zero knows" in warning
    low, warning = _read({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                                                "zero_hpz_partition_size": 8}})
    _only(low, stage=2)  # DeepSpeed offloads parameters and runs hpZ at stage 3 only
    assert "offload_param.device=\"cpu\": DeepSpeed offloads parameters at stage 3 only" in warning
    assert "zero_hpz_partition_size=8: DeepSpeed uses hpZ at stage 3 only" in warning


def test_reduction_and_accumulation_dtypes():
    config, _ = _read({"bf16": {"enabled": True}, "communication_data_type": "bf16",
                       "data_types": {"grad_accum_dtype": "fp32"}})
    assert (config.reduce_dtype, config.grad_accum_dtype) == ("compute", "fp32")
    config, _ = _read({"bf16": {"enabled": True}, "fp32_allreduce": True, "data_types": {"grad_accum_dtype": "bf16"}})
    assert (config.reduce_dtype, config.grad_accum_dtype) == ("fp32", "compute")
    config, warning = _read({"bf16": {"enabled": True}, "communication_data_type": "fp16"})
    assert config.reduce_dtype is None and 'communication_data_type="fp16"' in warning


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("ds, key", [
    ({"zero_optimization": {"stage": 5}}, "zero_optimization.stage=5"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage=\"two\""),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "zero_optimization.offload_optimizer.device"),
    ({"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size=-1"),
    ({"zero_optimization": {"reduce_bucket_size": 2.5}}, "zero_optimization.reduce_bucket_size=2.5"),
    ({"bf16": {"enabled": "yes"}}, "bf16.enabled"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16.enabled and fp16.enabled are both true"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps=0"),
    ({"gradient_clipping": -1.0}, "gradient_clipping=-1"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window=0"),
    ({"communication_data_type": "int8"}, "communication_data_type"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 4, "zero_hpz_partition_size": 2}}, "choose one"),
])
def test_a_bad_value_names_the_deepspeed_key(ds, key):
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_deepspeed(ds)
    assert key in str(info.value), str(info.value)
    assert str(info.value).startswith("(DeepSpeed config dict): ")
    if key == "choose one":  # options that do not fit together: both DeepSpeed keys are named
        assert "zero_optimization.mics_shard_size" in str(info.value)
        assert "zero_optimization.zero_hpz_partition_size" in str(info.value)


def test_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_deepspeed_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{stage: 3")
    with pytest.raises(ZeroConfigError, match="is not valid JSON"):
        read_deepspeed_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ZeroConfigError, match="a JSON object"):
        read_deepspeed_config(bad)


def test_overrides_win_over_the_file():
    config, _ = _read(ZEROPP_TUTORIAL, hpz_partition_size=None, reduce_bucket_size=1000)
    assert (config.hpz_partition_size, config.reduce_bucket_size) == (None, 1000)


# ------------------------------------------------------------------------------------------------ DeepSpeed itself
@pytest.mark.parametrize("name, ds", [("zero1", ZERO1_TUTORIAL), ("zero2", ZERO2_TUTORIAL),
                                      ("infinity", ZERO_INFINITY_TUTORIAL), ("offload", ZERO_OFFLOAD_TUTORIAL),
                                      ("zeropp", ZEROPP_TUTORIAL)])
@pytest.mark.needs_deepspeed
def test_keys_read_as_deepspeed_itself_reads_them(name, ds):
    """DeepSpeed's own parser of zero_optimization (aliases, deprecated flags) and ours agree on what each key
    sets: the stage, the bucket elements, the offload devices and hpZ. (DeepSpeed 0.19 removed MiCS, so its
    parser refuses the MiCS config; hf_zero still reads it, as HSDP.)"""
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    theirs = zero_config.DeepSpeedZeroConfig(**ds["zero_optimization"])
    ours = read_deepspeed_config(ds)
    element = 4  # none of these configs sets a precision
    assert ours.values["stage"] == int(theirs.stage)
    zero = ds["zero_optimization"]
    if "reduce_bucket_size" in zero:
        assert ours.values["reduce_bucket_size"] == theirs.reduce_bucket_size * element
    if "allgather_bucket_size" in zero:
        assert ours.values["allgather_bucket_size"] == theirs.allgather_bucket_size * element
    device = lambda offload: "none" if offload is None else str(getattr(offload.device, "value", offload.device))
    assert ours.values.get("offload_optimizer", "none") == device(theirs.offload_optimizer)
    assert ours.values.get("offload_params", "none") == device(theirs.offload_param)
    assert ours.values.get("hpz_partition_size") == (theirs.zero_hpz_partition_size
                                                     if theirs.zero_hpz_partition_size > 1 else None)


# ------------------------------------------------------------------------------------------------ docs table
def test_docs_deepspeed_table_is_the_rules():
    page = (ROOT / "docs" / "from_deepspeed.md").read_text()  # the table's home
    assert page_section(page, "deepspeed") == markdown(), "run `python -m hf_zero.options --write`"
    targets = {rule.target.strip("`").split("`")[0] for rule in RULES}
    for rule in RULES:
        for key in rule.keys:  # every key the reader knows is in the table
            assert key.rpartition(".")[2] in page_section(page, "deepspeed")
    # every option a DeepSpeed key sets is a declared option
    assert {t for t in targets if t in BY_NAME} >= {"stage", "mixed_precision", "reduce_bucket_size",
                                                    "allgather_bucket_size", "prefetch", "offload_optimizer",
                                                    "offload_params", "hpz_partition_size", "shard_group_size",
                                                    "reduce_dtype", "grad_accum_dtype", "initial_loss_scale",
                                                    "loss_scale_growth_interval", "min_loss_scale",
                                                    "activation_checkpointing", "cpu_checkpointing"}
