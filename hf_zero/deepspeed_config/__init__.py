"""A DeepSpeed config file read as hf_zero options.

`read_deepspeed_config(path_or_dict)` gives a `DeepSpeedSettings`; `ZeroConfig.from_deepspeed`,
`ZeroPlugin.from_deepspeed` and `hf-zero config --from-deepspeed FILE` are built on it. Every key of the file meets
one rule of `RULES` (the "DeepSpeed key -> hf_zero option" table of docs/from_deepspeed.md is written from them):

- it sets an hf_zero option, converted where the units differ (DeepSpeed counts bucket sizes in elements, hf_zero in
  bytes: elements x 2 under bf16/fp16, x 4 otherwise);
- it belongs to the training loop, not to the engine (gradient accumulation, clipping, the micro-batch size):
  `DeepSpeedSettings.accelerator_kwargs()` / `training_arguments()` carry those, and the warning says where they go;
- it asks for what hf_zero always does (`contiguous_gradients: true`, `overlap_comm: true`, ...): nothing to do;
- it cannot be honoured (NVMe offload, LoCo error feedback, DeepSpeed's optimizer section, ...), or it is a DeepSpeed tuning or
  logging knob with no counterpart (`sub_group_size`, `steps_per_print`, ...): named, with the reason, in ONE
  `DeepSpeedConfigWarning` per read. A key nobody knows is named too; nothing is dropped silently.

`"auto"` values resolve as Accelerate resolves them: the precision from Accelerate's `mixed_precision` (the
`mixed_precision` argument here), `reduce_bucket_size` from the model's hidden size (`hidden_size` argument:
hidden_size² elements; without it hf_zero's default), the stage as Accelerate's default 2, and everything else as
"the framework's choice", i.e. hf_zero's default. Keys the file does not set keep hf_zero's defaults, except the
stage: a file without `zero_optimization.stage` means DeepSpeed's stage 0. Bad values raise ZeroConfigError naming
the DeepSpeed key.

Ground floor, beside config.py: imports only hf_zero.options (config.py imports this package). settings.py holds
`DeepSpeedSettings` and the warning, rules.py the rules and the reader state they fill.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from ..options import OPTIONS, ZeroConfigError, check_values
from .rules import RULE_OF, RULES, Reader, Rule
from .settings import AUTO, DeepSpeedConfigWarning, DeepSpeedSettings, show_value

__all__ = ["read_deepspeed_config", "DeepSpeedSettings", "DeepSpeedConfigWarning", "Rule", "RULES", "AUTO",
           "markdown"]


def _load(config: Union[str, os.PathLike, Mapping[str, Any]]) -> Tuple[str, Dict[str, Any]]:
    if isinstance(config, Mapping):
        return "(DeepSpeed config dict)", dict(config)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ZeroConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ZeroConfigError(f"{path}: a DeepSpeed config is a JSON object, got {type(data).__name__}")
    return str(path), data


def _walk(data: Mapping[str, Any], prefix: str, found: List[Tuple[str, Any]]) -> None:
    for key, value in data.items():
        path = prefix + str(key)
        rule = RULE_OF.get(path)
        if value is None:
            continue  # JSON null: DeepSpeed's default
        if isinstance(value, dict) and not (rule and rule.section):
            _walk(value, path + ".", found)
        else:
            found.append((path, value))


def read_deepspeed_config(config: Union[str, os.PathLike, Mapping[str, Any]], *, mixed_precision: Optional[str] = None,
                          hidden_size: Optional[int] = None) -> DeepSpeedSettings:
    """What a DeepSpeed config (a JSON file or its dict) means for hf_zero; warns about nothing (see
    `DeepSpeedSettings.warn`).

    Args:
        config: path of the JSON file, or the parsed dict.
        mixed_precision: Accelerate's setting, which bf16/fp16 "enabled": "auto" (or no such section) resolves to.
        hidden_size: the model's hidden size, which "auto" bucket sizes are computed from (as Accelerate does).

    Raises ZeroConfigError naming the DeepSpeed key of a bad value, FileNotFoundError for a missing file."""
    source, data = _load(config)
    if "bfloat16" in data and "bf16" not in data:  # DeepSpeed's old name
        data["bf16"] = data.pop("bfloat16")
    r = Reader(source, mixed_precision, hidden_size)
    found: List[Tuple[str, Any]] = []
    _walk(data, "", found)
    order = {rule: i for i, rule in enumerate(RULES)}
    for key, value in sorted((kv for kv in found if kv[0] in RULE_OF), key=lambda kv: order[RULE_OF[kv[0]]]):
        RULE_OF[key].apply(r, key, value)
    for key, value in found:
        if key not in RULE_OF:
            r.ignore(key, value, "not a DeepSpeed key hf_zero knows")
    if "stage" not in r.out.values:
        r.out.values["stage"], r.out.origin["stage"] = 0, "zero_optimization.stage (not set: DeepSpeed's 0)"
    r.out.mixed_precision = r.precision
    decisive = [d for d, v in r.enabled.items() if v is True] or (
        list(r.enabled) if r.enabled and all(v is False for v in r.enabled.values()) else [])
    if decisive:  # the file itself fixes the precision
        r.out.origin["mixed_precision"] = " and ".join(f"{r.enabled_keys[d]}={show_value(r.enabled[d])}"
                                                       for d in decisive)
    _check_together(r)
    return r.out


def _check_together(r: Reader) -> None:
    """Options that are each fine but do not fit together: the error names their DeepSpeed keys."""
    values = {o.name: o.default for o in OPTIONS}
    values.update(r.out.values)
    values["mixed_precision"] = r.out.mixed_precision or "no"
    try:
        check_values(values, OPTIONS)
    except ZeroConfigError as exc:
        keys = [key for name, key in r.out.origin.items() if name in str(exc) and name in r.out.values]
        raise ZeroConfigError(f"{r.out.source}: {', '.join(keys) or 'the file'}: {exc}", exc.option) from None


def _keys_text(keys: Tuple[str, ...]) -> str:
    """`a.{b, c}` for keys that share a parent, in their order."""
    groups: Dict[str, List[str]] = {}
    for key in keys:
        parent, _, leaf = key.rpartition(".")
        groups.setdefault(parent, []).append(leaf)
    parts = []
    for parent, leaves in groups.items():
        inner = leaves[0] if len(leaves) == 1 else "{" + ", ".join(leaves) + "}"
        parts.append(f"`{parent + '.' if parent else ''}{inner}`")
    return ", ".join(parts)


def markdown() -> str:
    """The "DeepSpeed key -> hf_zero option" table of docs/from_deepspeed.md, one row per rule."""
    rows = ["| DeepSpeed key | hf_zero | how |", "|---|---|---|"]
    for rule in RULES:
        keys = _keys_text(rule.keys)
        rows.append(f"| {keys} | {rule.target} | {rule.how.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
