"""Random weights for a Llama of any layer count, never the whole model in memory: `write_safetensors` writes one
file a chunk at a time, `RandomCheckpoint` one file per decoder layer (reused by every size, trial and system of a
run) and a sharded folder per layer count that `hf_zero.from_pretrained` reads straight into shards."""
from __future__ import annotations

import json
import math
import os
import struct
import time
from typing import Any, Dict, List, Sequence, Tuple

_ST_DTYPES = {"fp32": ("F32", 4), "bf16": ("BF16", 2)}


def model_config(shape: Dict[str, int], layers: int) -> Dict[str, Any]:
    """A Llama config dict (model_type, untied embeddings, no KV cache) of `shape` with `layers` decoder layers."""
    heads = int(shape["num_attention_heads"])
    return {"model_type": "llama", "hidden_size": int(shape["hidden_size"]),
            "intermediate_size": int(shape["intermediate_size"]), "num_attention_heads": heads,
            "num_key_value_heads": int(shape.get("num_key_value_heads", heads)), "num_hidden_layers": int(layers),
            "vocab_size": int(shape["vocab_size"]), "max_position_embeddings": 2048, "tie_word_embeddings": False,
            "use_cache": False, "initializer_range": 0.02, "rms_norm_eps": 1e-5, "bos_token_id": 0,
            "eos_token_id": 0, "pad_token_id": 0}


def tensor_specs(cfg: Dict[str, Any]) -> Tuple[List[Tuple[str, Tuple[int, ...]]], List[Tuple[str, Tuple[int, ...]]]]:
    """(the names and shapes outside the decoder layers, those of layer 0 with "{i}" for the index), read from the
    model itself built on the meta device at one layer."""
    from hf_zero.integrations.hf_models import meta_model, quiet

    quiet()
    model = meta_model(hf_config({**cfg, "num_hidden_layers": 1}))
    rest, layer = [], []
    for name, t in model.state_dict().items():
        if name.startswith("model.layers.0."):
            layer.append(("model.layers.{i}." + name[len("model.layers.0."):], tuple(t.shape)))
        else:
            rest.append((name, tuple(t.shape)))
    return rest, layer


def hf_config(cfg: Dict[str, Any]):
    """The Transformers config object of a config dict."""
    from hf_zero.integrations.hf_models import config_from_dict

    return config_from_dict(cfg)


def write_safetensors(path: str, specs: Sequence[Tuple[str, Tuple[int, ...]]], dtype: str, seed: int,
                      std: float = 0.02, chunk_elements: int = 1 << 24) -> int:
    """Write a safetensors file of random tensors (normal(0, std); norm weights, 1-D, ones) one chunk at a time:
    at most `chunk_elements` values in memory, whatever the file's size. Returns its data bytes."""
    import torch

    st_dtype, esize = _ST_DTYPES[dtype]
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    header: Dict[str, Any] = {}
    offset = 0
    for name, shape in specs:
        n = math.prod(shape) * esize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    gen = torch.Generator().manual_seed(seed)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in specs:
            if len(shape) == 1:
                f.write(torch.ones(shape, dtype=torch_dtype).view(torch.uint8).numpy().tobytes())
                continue
            cols = math.prod(shape[1:])
            rows_per = max(1, chunk_elements // cols)
            for r0 in range(0, shape[0], rows_per):
                rows = min(rows_per, shape[0] - r0)
                t = torch.randn(rows, cols, generator=gen).mul_(std).to(torch_dtype)
                f.write(memoryview(t.view(torch.uint8).numpy()))
    os.replace(tmp, path)
    return offset


class RandomCheckpoint:
    """Random weights for the shape's Llama at any layer count, written one file per decoder layer (and one for the
    rest) the first time a layer count needs them, in `root`; `folder(L)` is a sharded checkpoint folder of L layers
    (config.json, model.safetensors.index.json and links to the layer files) that `hf_zero.from_pretrained` reads.
    Never more than one chunk of one tensor in memory."""

    def __init__(self, root: str, shape: Dict[str, int], dtype: str = "fp32", seed: int = 0) -> None:
        self.root, self.shape, self.dtype, self.seed = root, dict(shape), dtype, seed
        os.makedirs(os.path.join(root, "layers"), exist_ok=True)
        self.rest_specs, self.layer_specs = tensor_specs(model_config(shape, 1))
        self.written_s = 0.0

    def _layer_file(self, i: int) -> str:
        path = os.path.join(self.root, "layers", f"layer-{i:05d}.safetensors")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            specs = [(n.format(i=i), s) for n, s in self.layer_specs]
            write_safetensors(path, specs, self.dtype, seed=self.seed * 100003 + i + 1)
            self.written_s += time.perf_counter() - t0
        return path

    def _rest_file(self) -> str:
        path = os.path.join(self.root, "rest.safetensors")
        if not os.path.exists(path):
            t0 = time.perf_counter()
            write_safetensors(path, self.rest_specs, self.dtype, seed=self.seed * 100003)
            self.written_s += time.perf_counter() - t0
        return path

    def folder(self, layers: int) -> str:
        folder = os.path.join(self.root, f"L{layers}")
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.exists(index):
            return folder
        os.makedirs(folder, exist_ok=True)
        weight_map: Dict[str, str] = {}
        files = [("rest.safetensors", self._rest_file(), [n for n, _ in self.rest_specs])]
        for i in range(layers):
            files.append((f"layer-{i:05d}.safetensors", self._layer_file(i),
                          [n.format(i=i) for n, _ in self.layer_specs]))
        total = 0
        for name, target, keys in files:
            link = os.path.join(folder, name)
            if not os.path.lexists(link):
                os.symlink(target, link)
            weight_map.update({k: name for k in keys})
            total += os.path.getsize(target)
        hf_config(model_config(self.shape, layers)).save_pretrained(folder)
        with open(index + ".tmp", "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        os.replace(index + ".tmp", index)
        return folder

    def nbytes(self) -> int:
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for n in names:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    total += os.path.getsize(p)
        return total

