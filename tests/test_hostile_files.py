"""Issue 19 ("Trust under faults and hostile files"), the file checks that need no process group.

Item 4: every file name a checkpoint manifest holds must be a plain name inside the checkpoint folder; a manifest
that points elsewhere (`../`, an absolute path, a sub-folder, a symlink leading out) is a CheckpointError naming the
field and the value, from `load_checkpoint` and from the offline `export_pretrained`, and the engine is unchanged.
The hostile manifests are made to work otherwise: the outside file is a valid buffers file whose size and SHA-256
the manifest records, so only the name check can stop it.

Item 5: a safetensors header is checked against what the format promises before any tensor is read: the header
length within the file and under safetensors' own 100 MB cap (checked before reading, so a huge length costs no
memory), a JSON object of objects, known dtypes, shapes of non-negative ints, data offsets inside the data section,
as long as shape and dtype say, and not overlapping another tensor's. Each failure is a WeightsError naming the file
and the tensor (the checkpoint reader: a CheckpointError). An index whose weight_map leaves the folder is refused too.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from hf_zero import ZeroConfig, shard_model
from hf_zero.checkpoint import CheckpointError, export_pretrained, load_checkpoint, save_checkpoint
from hf_zero.checkpoint.source import sha256
from hf_zero.engine.weights import WeightsError, WeightSource


# ================================================================================ item 4: manifest file names
def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    model.register_buffer("scale", torch.linspace(0.5, 1.5, 5) * (seed + 1))  # persistent: in buffers.safetensors
    return model


def _engine(seed: int):
    model = _model(seed)
    return shard_model(model, torch.optim.AdamW(model.parameters()), ZeroConfig(stage=1))


def _state(engine) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A checkpoint of seed 0's model, saved in this process (world size 1)."""
    path = tmp_path_factory.mktemp("hostile") / "saved"
    engine = _engine(0)
    save_checkpoint(engine, str(path))
    engine.close()
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    return ckpt


def _outside_buffers(tmp_path: Path) -> Path:
    """A valid buffers file outside the checkpoint folder, holding other values than the saved ones."""
    path = tmp_path / "outside.safetensors"
    save_file({"scale": torch.full((5,), 99.0)}, str(path), metadata={"format": "hf_zero-sharded"})
    return path


def _edit(ckpt: Path, change: Callable[[Dict[str, Any]], None]) -> None:
    m = json.loads((ckpt / "manifest.json").read_text())
    change(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))


def _list_file(m: Dict[str, Any], name: str, path: Path) -> None:
    """Record `name` as the manifest records a file it wrote: checksum, size, writer."""
    m["files"][name] = sha256(path)
    m["file_bytes"][name] = path.stat().st_size
    m["writers"][name] = [["host", 0]]


def _refused(ckpt: Path, *needles: str) -> None:
    """load_checkpoint and export_pretrained both raise a CheckpointError holding every needle; the engine keeps
    its values and no export folder appears."""
    engine = _engine(1)  # other values than the checkpoint's: a load that went through would change them
    before = _state(engine)
    try:
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(engine, str(ckpt))
        after = _state(engine)
    finally:
        engine.close()
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before), \
        "a refused load changed the engine"
    out = ckpt.parent / "export"
    with pytest.raises(CheckpointError) as err:
        export_pretrained(str(ckpt), str(out), progress=False)
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"
    assert not out.exists(), "a refused export left an output folder"


def test_intact_checkpoint_loads_and_exports(saved, tmp_path):
    """The baseline of the cases below: the same steps on the untouched copy succeed and load seed 0's values."""
    ckpt = _copy(saved, tmp_path)
    engine = _engine(1)
    load_checkpoint(engine, str(ckpt))
    assert torch.equal(engine.model.scale, torch.linspace(0.5, 1.5, 5))
    engine.close()
    export_pretrained(str(ckpt), str(tmp_path / "export"), progress=False)
    assert (tmp_path / "export" / "model.safetensors").is_file()


@pytest.mark.parametrize("value", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors",
                                   "..\\outside.safetensors", "", ".", "..", "buffers\x00.safetensors"])
def test_buffers_file_must_stay_in_the_folder(saved, tmp_path, value):
    ckpt = _copy(saved, tmp_path)
    outside = _outside_buffers(tmp_path)
    value = str(outside) if value == "ABSOLUTE" else value

    def change(m):
        m["buffers_file"] = value
        _list_file(m, value, outside)  # checksum and size match the outside file: only the name check stops it

    _edit(ckpt, change)
    _refused(ckpt, "buffers_file", repr(value))


def test_buffers_file_must_be_a_string(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    _edit(ckpt, lambda m: m.update(buffers_file=["buffers.safetensors"]))
    _refused(ckpt, "buffers_file", repr(["buffers.safetensors"]))


@pytest.mark.parametrize("field", ["files", "file_bytes", "file_copies_sha256", "writers"])
@pytest.mark.parametrize("value", ["../outside.safetensors", "ABSOLUTE", "sub/rank00000-of-00001.safetensors"])
def test_every_file_name_field_must_stay_in_the_folder(saved, tmp_path, field, value):
    ckpt = _copy(saved, tmp_path)
    outside = _outside_buffers(tmp_path)
    value = str(outside) if value == "ABSOLUTE" else value
    entry = {"files": sha256(outside), "file_bytes": outside.stat().st_size,
             "file_copies_sha256": [sha256(outside)], "writers": [["host", 0]]}[field]
    _edit(ckpt, lambda m: m.setdefault(field, {}).update({value: entry}))
    _refused(ckpt, repr(field), repr(value))


@pytest.mark.parametrize("name", ["buffers.safetensors", "rank00000-of-00001.safetensors"])
def test_symlink_leading_out_of_the_folder_is_refused(saved, tmp_path, name):
    """The file the manifest names is a symlink to a copy outside the folder (same bytes: checksum and size
    match), so only the symlink check can stop it."""
    ckpt = _copy(saved, tmp_path)
    outside = tmp_path / f"elsewhere-{name}"
    os.replace(ckpt / name, outside)
    os.symlink(outside, ckpt / name)
    _refused(ckpt, name, "outside")


def test_symlinks_inside_the_folder_are_fine(saved, tmp_path):
    """A file linked to another one in the same folder, and the whole folder reached through a link, load."""
    ckpt = _copy(saved, tmp_path)
    os.replace(ckpt / "buffers.safetensors", ckpt / "buffers-real.safetensors")
    os.symlink("buffers-real.safetensors", ckpt / "buffers.safetensors")
    link = tmp_path / "link-to-ckpt"
    os.symlink(ckpt, link)
    engine = _engine(1)
    load_checkpoint(engine, str(link))
    assert torch.equal(engine.model.scale, torch.linspace(0.5, 1.5, 5))
    engine.close()
    export_pretrained(str(link), str(tmp_path / "export"), progress=False)
    assert (tmp_path / "export" / "model.safetensors").is_file()


# ================================================================================ item 5: safetensors headers
Header = Dict[str, Any]


def _small_file(path: Path) -> Path:
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.arange(4, dtype=torch.int64)},
              str(path), metadata={"format": "pt"})
    return path


def _split(path: Path) -> Tuple[Header, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _rewrite(path: Path, header: Any = None, data: bytes = None, raw_header: bytes = None,
             length: int = None) -> Path:
    """`path` with another header (a JSON value or raw bytes) and/or data section, and/or a false length."""
    old_header, old_data = _split(path)
    text = raw_header if raw_header is not None else json.dumps(old_header if header is None else header).encode()
    data = old_data if data is None else data
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def _with(header: Header, tensor: str, **fields: Any) -> Header:
    header = json.loads(json.dumps(header))
    header[tensor].update(fields)
    return header


def _reject(path: Path, tensor: str = None) -> str:
    """Reading every tensor of `path` raises a WeightsError naming the file (and `tensor`)."""
    with pytest.raises(WeightsError) as err:
        src = WeightSource(path)
        try:
            for key in src.keys():
                src.read(key)
        finally:
            src.close()
    msg = str(err.value)
    assert path.name in msg, msg
    if tensor is not None:
        assert repr(tensor) in msg, msg
    return msg


def test_intact_file_reads(tmp_path):
    src = WeightSource(_small_file(tmp_path / "w.safetensors"))
    assert torch.equal(src.read("a"), torch.arange(6, dtype=torch.float32))
    assert torch.equal(src.read("b", 1, 3), torch.tensor([1, 2]))
    src.close()


# (case, how the header changes, the tensor the message must name)
HEADER_CASES = [
    ("list entry", lambda h: {**h, "a": [1, 2]}, "a"),
    ("entry not an object", lambda h: {**h, "a": "F32"}, "a"),
    ("missing shape", lambda h: {**h, "a": {"dtype": "F32", "data_offsets": h["a"]["data_offsets"]}}, "a"),
    ("unknown dtype", lambda h: _with(h, "a", dtype="F31"), "a"),
    ("dtype not a string", lambda h: _with(h, "a", dtype=["F32"]), "a"),
    ("float shape", lambda h: _with(h, "a", shape=[2.0, 3]), "a"),
    ("negative shape", lambda h: _with(h, "a", shape=[-2, -3]), "a"),
    ("bool shape", lambda h: _with(h, "b", shape=[True, 4]), "b"),
    ("shape not a list", lambda h: _with(h, "a", shape=6), "a"),
    ("negative offset: into the header", lambda h: _with(h, "a", data_offsets=[-8, 16]), "a"),
    ("one offset", lambda h: _with(h, "a", data_offsets=[0]), "a"),
    ("float offsets", lambda h: _with(h, "a", data_offsets=[0.0, 24.0]), "a"),
    ("offsets reversed", lambda h: _with(h, "a", data_offsets=[24, 0]), "a"),
    ("offsets beyond the file", lambda h: _with(h, "b", data_offsets=[4096, 4128]), "b"),
    ("end beyond the file", lambda h: _with(h, "b", data_offsets=[24, 4128]), "b"),
    ("overlapping offsets", lambda h: _with(h, "b", data_offsets=[8, 40]), None),
    ("shorter than shape and dtype", lambda h: _with(h, "a", data_offsets=[0, 12]), "a"),
    ("longer than shape and dtype", lambda h: _with(h, "a", shape=[2, 2]), "a"),
    ("metadata not an object", lambda h: {**h, "__metadata__": ["format", "pt"]}, "__metadata__"),
    ("metadata value not a string", lambda h: {**h, "__metadata__": {"format": 1}}, "__metadata__"),
    ("header a list", lambda h: [h], None),
]


@pytest.mark.parametrize("case,change,tensor", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_damaged_header_is_refused(tmp_path, case, change, tensor):
    path = _small_file(tmp_path / "w.safetensors")
    header, _ = _split(path)
    _rewrite(path, change(header))
    msg = _reject(path, tensor)
    if case == "overlapping offsets":
        assert "'a'" in msg and "'b'" in msg and "overlap" in msg, msg


def test_duplicate_tensor_names_are_refused(tmp_path):
    """json.loads keeps the last of two equal keys: one tensor's entry would silently hide the other's."""
    path = _small_file(tmp_path / "w.safetensors")
    header, _ = _split(path)
    text = json.dumps(header)[:-1] + ', "a": ' + json.dumps(header["a"]) + "}"
    _rewrite(path, raw_header=text.encode())
    _reject(path, "a")


@pytest.mark.parametrize("raw", [b"not json at all", b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000],
                         ids=["not JSON", "not UTF-8", "nested too deep"])
def test_header_that_is_not_json_is_refused(tmp_path, raw):
    _reject(_rewrite(_small_file(tmp_path / "w.safetensors"), raw_header=raw))


def _peak_while_rejecting(path: Path) -> Tuple[str, int]:
    tracemalloc.start()
    try:
        msg = _reject(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return msg, peak


@pytest.mark.parametrize("length", [2**64 - 1, 2**63, 99_000_000, 10_000],
                         ids=["2^64-1", "2^63", "99 MB", "beyond the file"])
def test_header_length_beyond_the_file_costs_no_memory(tmp_path, length):
    """A length the file cannot hold is refused before anything is read (no 99 MB read attempt)."""
    path = _rewrite(_small_file(tmp_path / "w.safetensors"), length=length)
    msg, peak = _peak_while_rejecting(path)
    assert peak < 1 << 20, f"rejecting a header length of {length} allocated {peak} bytes"
    assert "header" in msg and str(length) in msg, msg


def test_header_over_safetensors_cap_is_refused_unread(tmp_path):
    """A header length over 100 MB in a (sparse) file that long: refused by the cap, not read."""
    path = tmp_path / "big.safetensors"
    length = 100_000_001
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", length) + b"{")
        f.truncate(8 + length + 64)
    msg, peak = _peak_while_rejecting(path)
    assert peak < 1 << 20, f"rejecting allocated {peak} bytes"
    assert "100000000" in msg or "100 MB" in msg, msg


def test_index_must_map_into_the_folder(tmp_path):
    """model.safetensors.index.json may only name files inside its folder (and must map names to names)."""
    folder = tmp_path / "model"
    folder.mkdir()
    _small_file(folder / "model-00001-of-00001.safetensors")
    outside = _small_file(tmp_path / "outside.safetensors")
    index = folder / "model.safetensors.index.json"
    for bad in ("../outside.safetensors", str(outside), "sub/../../outside.safetensors"):
        index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": bad}}))
        with pytest.raises(WeightsError) as err:
            src = WeightSource(folder)
            src.read("b")
        assert index.name in str(err.value) and repr("b") in str(err.value) and repr(bad) in str(err.value), \
            str(err.value)
    index.write_text(json.dumps({"weight_map": [["a", "model-00001-of-00001.safetensors"]]}))
    with pytest.raises(WeightsError, match="weight_map"):
        WeightSource(folder)
    index.write_text(json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors",
                                                "b": "model-00001-of-00001.safetensors"}}))
    assert torch.equal(WeightSource(folder).read("b"), torch.arange(4))  # the intact index reads


def test_checkpoint_reader_uses_the_same_checks(tmp_path):
    """The checkpoint's rank-file reader refuses the same damage (as a CheckpointError naming file and tensor)."""
    from hf_zero.checkpoint.source import _RankFile

    for case, change, tensor in HEADER_CASES:
        path = _small_file(tmp_path / f"{case.replace(' ', '_').replace(':', '')}.safetensors")
        header, _ = _split(path)
        _rewrite(path, change(header))
        with pytest.raises(CheckpointError) as err:
            f = _RankFile(path)
            for key in f.keys():
                f.read(key, 0, 1)
        assert path.name in str(err.value), (case, str(err.value))
        if tensor is not None:
            assert repr(tensor) in str(err.value), (case, str(err.value))
