"""A folder another system wrote, opened as a `ForeignSource` for hf_zero's loader, or None when it is not one."""
from __future__ import annotations

from typing import Optional

from .foreign import inspect_foreign
from .foreign_source import ForeignSource

__all__ = ["open_foreign"]


def open_foreign(folder: str, trust: bool = False) -> Optional[ForeignSource]:
    """The DeepSpeed ZeRO or DCP checkpoint in `folder` as a source `sharded.stage_checkpoint` loads at any world size
    and stage; None when the folder is neither (CheckpointError when it is one but damaged or incomplete)."""
    found = inspect_foreign(folder, trust)
    if found is None:
        return None
    if found.kind == "deepspeed":
        from .from_deepspeed import DeepSpeedSource

        return DeepSpeedSource(found, trust)
    from .from_dcp import DcpSource

    return DcpSource(found, trust)
