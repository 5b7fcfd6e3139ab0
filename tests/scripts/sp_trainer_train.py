"""Worker for tests/test_sequence_parallel_trainer.py: the Trainer, TRL's SFTTrainer (packing, padding-free)
and SFT with a PEFT LoRA adapter, stock (backend "stock": one plain process, before hf_zero is imported) or on hf_zero
(backend "zero": every rank of a torchrun launch runs this, with ZeroPlugin(sequence_parallel_size=sp)); one case
after another in one process.

argv: OUT CASES_JSON [--zero] (--zero: import hf_zero first, as a torchrun launch must; a plain process imports
it at its first hf_zero case, after the stock ones). Each case: {"name", "kind": "trainer" | "sft" | "sft_lora" |
"dpo", "backend", "sp", "stage", "avg" (TrainingArguments.average_tokens_across_devices), optional "batch",
"max_steps", "save_steps", "resume" (a checkpoint folder), "tokens" (include_num_input_tokens_seen), "eval_rows"
(trainer.evaluate() at the end on that many rows)}. On the main
process it writes OUT/<name>.json (the logged losses and grad norms, the tokens seen, the samples per step, the
evaluation loss) and
OUT/<name>/ (trainer.save_model: the weights, or the adapter); every rank writes OUT/<name>.rank<R>.batches.json (a
fingerprint of every row of every batch the model was called with, whole). A case with "refused" (and
"compute_loss_func", "compute_metrics", "label_smoothing" or kind "dpo") is one hf_zero must refuse: every rank
writes the error it got to OUT/<name>.rank<R>.error.txt.
"""
import json
import os
import sys

ZERO = "--zero" in sys.argv
if ZERO:
    import hf_zero  # noqa: F401  (first: the Accelerate state is a gloo world on CPU)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer,  # noqa: E402
                          TrainingArguments)

VOCAB, SEQ = 102, 16  # ids 100 and 101: <pad>, <eos>


def make_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=100,
                         eos_token_id=101, bos_token_id=None, tie_word_embeddings=False, use_cache=False,
                         initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def tokenizer():
    vocab = {f"w{i}": i for i in range(100)}
    vocab.update({"<pad>": 100, "<eos>": 101})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def trainer_data():
    """Rows of SEQ tokens, right-padded (attention_mask 0, labels -100) by 0, 3 or 6 and -100 inside some: every
    micro-batch counts a different number of targets, so the loss's denominator matters."""
    g = torch.Generator().manual_seed(1)
    rows = {"input_ids": [], "attention_mask": [], "labels": []}
    for i in range(48):
        ids = torch.randint(0, 100, (SEQ,), generator=g)
        keep = SEQ - (i % 3) * 3
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[:keep] = 1
        labels = ids.clone()
        labels[keep:] = -100
        if i % 4 == 1:
            labels[2:5] = -100
        ids[keep:] = 100
        rows["input_ids"].append(ids.tolist())
        rows["attention_mask"].append(mask.tolist())
        rows["labels"].append(labels.tolist())
    return Dataset.from_dict(rows)


def sft_data():
    """Documents of 3 to 13 words: packing (best-fit decreasing) puts several in a row of 16 tokens."""
    g = torch.Generator().manual_seed(1)
    texts = []
    for i in range(40):
        n = 3 + int(torch.randint(0, 11, (1,), generator=g))
        texts.append(" ".join(f"w{int(t)}" for t in torch.randint(0, 100, (n,), generator=g)))
    return Dataset.from_dict({"text": texts})


def build(case, out):
    kind, zero = case["kind"], case.get("backend", "stock") == "zero"
    common = dict(output_dir=os.path.join(out, case["name"] + ".run"), max_steps=case.get("max_steps", 3),
                  per_device_train_batch_size=case.get("batch", 2), gradient_accumulation_steps=2,
                  # adam_epsilon 1e-3: with 1e-8 Adam turns summation-order noise in near-zero gradient elements
                  # into visible steps (docs/architecture.md, "Numerics in tests")
                  max_grad_norm=1.0, learning_rate=2e-2, adam_epsilon=1e-3, logging_steps=1, report_to=[],
                  use_cpu=True, bf16=False, seed=0, disable_tqdm=True, dataloader_drop_last=True,
                  average_tokens_across_devices=case.get("avg", True),
                  save_strategy="steps" if case.get("save_steps") else "no", save_steps=case.get("save_steps") or 500,
                  include_num_input_tokens_seen="all" if case.get("tokens") else "no", per_device_eval_batch_size=2)
    kwargs = {}
    if zero:
        from hf_zero import ZeroPlugin

        kwargs["zero_plugin"] = ZeroPlugin(stage=case.get("stage", 2), sequence_parallel_size=case.get("sp", 1),
                                           reduce_bucket_size=4096, allgather_bucket_size=4096)
    kwargs["model"] = make_model()
    if case.get("label_smoothing"):
        common["label_smoothing_factor"] = 0.1
    if case.get("compute_metrics"):
        kwargs["compute_metrics"] = lambda prediction: {}
    if case.get("compute_loss_func"):
        kwargs["compute_loss_func"] = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    if kind == "trainer":
        cls = Trainer
        if zero:
            from hf_zero import ZeroTrainer as cls
        return cls(args=TrainingArguments(**common), train_dataset=trainer_data(), **kwargs)
    if kind == "dpo":
        from hf_zero import zero_trainer
        from peft import LoraConfig
        from trl import DPOConfig, DPOTrainer

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        data = sft_data()["text"]
        pairs = Dataset.from_dict({"prompt": data[:16], "chosen": data[16:32], "rejected": data[24:40]})
        return zero_trainer(DPOTrainer)(args=DPOConfig(**common, max_length=SEQ), train_dataset=pairs,
                                        processing_class=tokenizer(), **kwargs)
    from trl import SFTConfig, SFTTrainer

    cls = SFTTrainer
    if zero:
        from hf_zero import zero_trainer

        cls = zero_trainer(SFTTrainer)
    # packing: best-fit decreasing, padding-free (TRL's default strategy); no pad_to_multiple_of (hf_zero's part)
    config = SFTConfig(**common, max_length=SEQ, packing=True, activation_checkpointing=kind == "sft_lora")
    if kind == "sft_lora":
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return cls(args=config, train_dataset=sft_data(), processing_class=tokenizer(), **kwargs)


def refused(case, out):
    """Build and train a case hf_zero must refuse; every rank writes OUT/<name>.rank<R>.error.txt: the error."""
    try:
        build(case, out).train()
        said = "no error"
    except (ValueError, NotImplementedError) as e:
        said = f"{type(e).__name__}: {e}"
    with open(os.path.join(out, f"{case['name']}.rank{os.environ.get('RANK', '0')}.error.txt"), "w") as f:
        f.write(said)


def run(case, out):
    if case.get("refused"):
        return refused(case, out)
    trainer = build(case, out)
    batches = []

    def record(module, args, kwargs):  # registered before hf_zero's cut (prepare runs in train()): the whole batch
        ids = kwargs.get("input_ids", args[0] if args else None)
        if module.training and ids is not None:
            batches.append({"shape": list(ids.shape),
                            "rows": [int((row * torch.arange(1, row.numel() + 1)).sum()) for row in ids]})

    trainer.model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train(resume_from_checkpoint=case.get("resume"))
    rank = trainer.args.process_index
    with open(os.path.join(out, f"{case['name']}.rank{rank}.batches.json"), "w") as f:
        json.dump(batches, f)
    trainer.save_model(os.path.join(out, case["name"]))
    evaluated = {}
    if case.get("eval_rows"):  # the first rows of the training data, in batches of 2: the last one uneven
        evaluated = trainer.evaluate(eval_dataset=trainer_data().select(range(case["eval_rows"])))
    if trainer.args.should_save:
        logs = trainer.state.log_history
        with open(os.path.join(out, f"{case['name']}.json"), "w") as f:
            json.dump({"losses": [h["loss"] for h in logs if "loss" in h],
                       "norms": [h["grad_norm"] for h in logs if "grad_norm" in h],
                       "num_tokens": [h["num_tokens"] for h in logs if "num_tokens" in h],  # TRL's
                       "tokens_seen": trainer.state.num_input_tokens_seen,
                       "total_batch": trainer.get_total_train_batch_size(trainer.args),
                       "eval_loss": evaluated.get("eval_loss"), "world": trainer.args.world_size}, f)
    if ZERO:
        trainer.accelerator.wait_for_everyone()
        trainer.accelerator.free_memory()


if __name__ == "__main__":
    for c in json.loads(sys.argv[2]):
        run(c, sys.argv[1])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads sometimes abort the interpreter's teardown (tests/scripts/trainer_train.py)
