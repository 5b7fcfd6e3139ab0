"""Checkpoints: sharded training state (save / load / reshard at any world size)."""
from .sharded import CheckpointError, load_checkpoint, save_checkpoint

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
