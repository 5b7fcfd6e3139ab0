"""Worker for tests/test_sequence_parallel.py's flex case (torchrun, 2 ranks): the loss of a packed batch under
sp = 2 with flex_attention (forward only: torch's flex attention has no CPU backward) and plain flex in one rank.
Writes OUT/flex.rank<R>.json."""
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from hf_zero.engine.sequence import SequenceGroups
from hf_zero.integrations.sequence_parallel import enable_long_sequences

dist.init_process_group("gloo")
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, use_cache=False, attn_implementation="flex_attention")
plain, model = LlamaForCausalLM(config), LlamaForCausalLM(config)
model.load_state_dict(plain.state_dict())
enable_long_sequences(model, SequenceGroups.build(2))
ids = torch.randint(0, 128, (2, 16))
positions = torch.cat([torch.arange(7), torch.arange(9)])[None].expand(2, 16)  # two documents per row
with torch.no_grad():
    ref = plain(input_ids=ids, labels=ids, position_ids=positions).loss.item()
    got = model(input_ids=ids, labels=ids, position_ids=positions).loss.item()
    causal = plain(input_ids=ids, labels=ids).loss.item()  # the documents not told apart: must differ
with open(os.path.join(sys.argv[1], f"flex.rank{dist.get_rank()}.json"), "w") as f:
    json.dump({"plain": ref, "sp": got, "causal": causal}, f)
dist.destroy_process_group()
