"""Ulysses sequence parallelism (torch only): a sequence split across the `sp` ranks of a group, attention heads
all-to-all'd so each rank attends over the whole sequence for its share of the heads.

groups (which ranks share a sequence) -> batch (a batch cut into per-rank chunks, labels shifted first) ->
all_to_all (the differentiable exchange) -> attention (the Ulysses wrapper around any attention kernel) -> loss
(the whole sequence's loss from per-rank chunks); tiled (the loss and the MLP over tiles of tokens, for long
sequences with or without sp). ZeRO is untouched: it partitions over all N = dp x sp ranks, and
the loss scales each rank's share so that the engine's average over N is plain training's average over dp.
integrations/sequence_parallel.py plugs these into Transformers models.
"""
from .all_to_all import all_to_all
from .attention import ulysses_attention
from .batch import SequenceBatch, shard_inputs
from .groups import SequenceGroups
from .loss import sequence_parallel_loss
from .tiled import TiledMLP, tiled_cross_entropy_sum

__all__ = ["SequenceBatch", "SequenceGroups", "TiledMLP", "all_to_all", "sequence_parallel_loss", "shard_inputs",
           "tiled_cross_entropy_sum", "ulysses_attention"]
