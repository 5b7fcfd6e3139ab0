"""The models, data and plain reference of tests/test_sequence_parallel.py, shared with its worker
(tests/scripts/sp_train.py) so both train the same thing."""
from typing import Dict, List

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB, SEQ, BATCH = 64, 16, 2
STEPS, ACCUM = 2, 2
LR, MAX_NORM = 1e-2, 0.5


def make_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind.startswith("llama"):  # llama_kv2: GQA, 4 query heads on 2 KV heads; llama_kv1: one KV head
        kv = int(kind.rsplit("kv", 1)[1]) if "kv" in kind else 4
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64,
                             tie_word_embeddings=False, use_cache=False, initializer_range=0.2,
                             attn_implementation="sdpa")
        return LlamaForCausalLM(config)
    if kind == "gpt2":  # tied embeddings, absolute positions
        config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=48,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                            attn_implementation="sdpa")
        return GPT2LMHeadModel(config)
    raise ValueError(kind)


def samples(data: str, dp: int) -> List[Dict[str, torch.Tensor]]:
    """plain: every token a target; padded: right padding (attention_mask 0, labels -100) in some rows and -100
    inside others; packed: two documents per row, position ids restarting (no padding mask)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(BATCH * ACCUM * STEPS * dp):  # every replica reads STEPS x ACCUM batches
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        row = {"input_ids": ids, "labels": ids.clone()}
        if data == "padded":
            keep = SEQ - (i % 3) * 3
            mask = torch.zeros(SEQ, dtype=torch.long)
            mask[:keep] = 1
            row["labels"][keep:] = -100
            row["labels"][2:4] = -100
            row["attention_mask"] = mask
        elif data == "packed":
            cut = 5 + i % 7
            row["position_ids"] = torch.cat([torch.arange(cut), torch.arange(SEQ - cut)])
        elif data != "plain":
            raise ValueError(data)
        out.append(row)
    return out


def loader(data: str, dp: int) -> DataLoader:
    return DataLoader(samples(data, dp), batch_size=BATCH, shuffle=False)


def eval_loader(data: str, dp: int) -> DataLoader:
    """An evaluation set one row longer than a round of the replicas' batches: the last batch is uneven, so
    gather_for_metrics must cut the rows that even_batches repeats."""
    return DataLoader(samples(data, dp)[:BATCH * dp + 1], batch_size=BATCH, shuffle=False)


def plain_eval_losses(kind: str, state: Dict[str, torch.Tensor], data: str, dp: int) -> List[float]:
    """The loss of every full batch of `eval_loader` under the weights `state`, in plain Transformers."""
    model = make_model(kind)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return [model(**b).loss.item() for b in eval_loader(data, dp) if len(b["input_ids"]) == BATCH]


def plain_training(kind: str, data: str, dp: int):
    """Single-process training on what dp replicas read (replica d reads batches d, d + dp, ...: Accelerate's
    sharding), each replica's loss averaged as DDP averages gradients. Returns (losses per replica, the gradient
    norm of every step, weights)."""
    model = make_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = list(loader(data, dp))
    losses: List[List[float]] = [[] for _ in range(dp)]
    norms: List[float] = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            for d in range(dp):
                loss = model(**batches[(step * ACCUM + micro) * dp + d]).loss
                losses[d].append(loss.item())
                (loss / (ACCUM * dp)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
