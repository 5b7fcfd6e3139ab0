"""Checkpoints: sharded training state (save / load / reshard at any world size), the consolidated Hugging Face
export (from a live engine or offline from the shard files) and the Hub push."""
from .export import export_pretrained
from .hub import push_to_hub
from .publish import is_checkpoint, resolve as resolve_checkpoint
from .sharded import load_checkpoint, save_checkpoint, stage_checkpoint
from .source import CheckpointError, read_manifest

__all__ = ["CheckpointError", "export_pretrained", "is_checkpoint", "load_checkpoint", "push_to_hub", "read_manifest",
           "resolve_checkpoint", "save_checkpoint", "stage_checkpoint"]
