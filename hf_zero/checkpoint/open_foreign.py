"""A checkpoint folder another system wrote, opened as the `ForeignSource` of its format (or None if it is none
hf_zero reads): DeepSpeed ZeRO (from_deepspeed.py), a DCP folder (from_dcp.py: FSDP2, torchtitan, `dcp.save`)
and Accelerate's FSDP2 `save_state` folder (two DCP folders, model and optimizer, read as one)."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from .foreign import inspect_foreign
from .foreign_source import ForeignSource

__all__ = ["open_foreign"]


def open_foreign(folder: str, trust: bool = False,
                 parameters: Optional[Mapping[str, Sequence[str]]] = None) -> Optional[ForeignSource]:
    """The folder's `ForeignSource`, or None when it is neither a DeepSpeed ZeRO nor a DCP checkpoint. A folder
    that is one but is damaged raises CheckpointError naming the file; a pickle that would run code raises
    UntrustedPickleError unless `trust`. `parameters` (`from_dcp.parameter_names(model)`) tells a DCP checkpoint's
    frozen parameters from its buffers; DeepSpeed records the difference itself."""
    from .from_dcp import DcpSource, inspect_fsdp2_output
    from .from_deepspeed import DeepSpeedSource

    found = inspect_foreign(folder, trust) or inspect_fsdp2_output(folder, trust)
    if found is None:
        return None
    if found.kind == "deepspeed":
        return DeepSpeedSource(found, trust)
    if found.kind == "dcp":
        return DcpSource(found, trust, parameters)
    return None
