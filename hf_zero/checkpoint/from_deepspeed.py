"""A DeepSpeed ZeRO checkpoint (stages 1-3, any data-parallel world size) as a `ForeignSource`.

Where DeepSpeed puts each parameter's elements, from the folder's own records (never from DeepSpeed's code):

- Every rank's optimizer file holds its partition of the fp32 master and of each Adam moment, as flat tensors,
  and Adam's step. The model-states file records `param_shapes` (per parameter group, in flat order), the
  frozen parameters, the ties (`shared_params`) and the buffers (in `module`).
- Stages 1-2 (`single_partition_of_fp32_groups`): per parameter group the parameters lie one after another in
  one flat space cut into `partition_count` partitions, rank r holding partition r (equal and padded at the end
  under ZeRO's optimizer; under BF16_Optimizer the last one is short). The
  file's `param_slice_mappings` (where each parameter's fragment starts in the rank's partition) is checked
  against that layout, so a layout DeepSpeed changed is an error naming the parameter, not wrong weights.
- Stage 3 (`fp32_flat_groups`): every parameter is split on its own into ceil(numel / W) elements per rank (the
  last rank's part padded), and rank r's flat tensor is its parts of all parameters in `param_shapes` order
  (concatenated over parameter groups and sub-groups).

The rank files are memory-mapped, so a rank reads only the pages of the ranges it loads.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

import torch

from .foreign import ForeignCheckpoint, read_deepspeed_file
from .foreign_source import ADAM_STATE, HYPER_PARAMETERS, ForeignSource, ParamInfo, json_value
from .source import CheckpointError

__all__ = ["DeepSpeedSource"]


def _model_states_file(folder: str, rank: int) -> Optional[str]:
    for name in (f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", "mp_rank_00_model_states.pt"):
        if os.path.isfile(os.path.join(folder, name)):
            return name
    return None


def _optim_file(folder: str, rank: int) -> str:
    plain = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    for name in (plain, f"bf16_{plain}"):  # bf16_: DeepSpeed's BF16_Optimizer
        if os.path.isfile(os.path.join(folder, name)):
            return name
    raise CheckpointError(f"{folder}: DeepSpeed optimizer states of rank {rank} are missing ({plain}): copy every "
                          f"rank's file")


class DeepSpeedSource(ForeignSource):
    """Reads a DeepSpeed ZeRO checkpoint (`found` from `inspect_foreign`) per parameter, at any world size."""

    kind = "deepspeed"

    def __init__(self, found: ForeignCheckpoint, trust: bool = False) -> None:
        self.folder, self.trust = found.folder, trust
        self.ranks = found.world_size
        self._files: Dict[str, Any] = {}
        model_file = _model_states_file(self.folder, 0)
        if model_file is None:
            raise CheckpointError(f"{self.folder}: DeepSpeed's model states (mp_rank_00_model_states.pt) are "
                                  f"missing: copy the whole checkpoint folder")
        self.model_file = model_file
        model = self.open_file(model_file)
        first = self.open_file(_optim_file(self.folder, 0))["optimizer_state_dict"]
        stage = int(first.get("zero_stage", 3 if "fp32_flat_groups" in first else 2))
        self.stage = stage if "fp32_flat_groups" in first else min(stage, 2) or 1
        shapes: List[Dict[str, Any]] = model.get("param_shapes") or []
        if not shapes:
            raise CheckpointError(f"{self.folder}/{model_file} records no param_shapes: not a ZeRO checkpoint "
                                  f"(stage 0 / DDP checkpoints hold the full model: load its `module`)")
        ties: Dict[str, List[str]] = {}
        for pair in model.get("shared_params") or []:  # (alias, the parameter it is saved as)
            ties.setdefault(pair[1], []).append(pair[0])
        params = [ParamInfo(name, list(shape), "float32", True, gi, ties.get(name, ()))
                  for gi, group in enumerate(shapes) for name, shape in group.items()]
        frozen = model.get("frozen_param_shapes") or {}
        params += [ParamInfo(name, list(shape), "float32", False, 0, ties.get(name, ()))
                   for name, shape in frozen.items()]
        self._pieces: Dict[str, List[Tuple[int, int, int, int]]] = {}  # name -> (rank, rank offset, param lo, count)
        self._steps: List[List[Tuple[int, int, Optional[float]]]] = []  # per rank: (start, end, step) of its state
        self._layout(params, shapes)
        groups = self._param_groups(first, params, len(shapes))
        buffers = [n for n in (model.get("buffer_names") or []) if n in (model.get("module") or {})]
        buffer_info = [{"name": n, "aliases": [n], "shape": list(model["module"][n].shape),
                        "dtype": str(model["module"][n].dtype).replace("torch.", "")} for n in buffers]
        scaler = first.get("loss_scaler")
        scale = getattr(scaler, "cur_scale", None)
        loss_scaler = {"scale": float(scale), "good_steps": int(getattr(scaler, "cur_iter", 0) or 0)
                       - int(getattr(scaler, "last_overflow_iter", -1) or -1) - 1} \
            if getattr(scaler, "dynamic", False) and scale is not None else None
        self.lr_scheduler = model.get("lr_scheduler")
        step = found.step if found.step is not None else model.get("global_steps")  # Accelerate's tag has none
        module = model.get("module") or {}
        for p in params:  # the dtype it trained in (the master is fp32): what an export writes
            t = module.get(p.name)
            if torch.is_tensor(t) and t.is_floating_point():
                p.dtype = str(t.dtype).replace("torch.", "")
        super().__init__(self.folder, f"a DeepSpeed ZeRO-{self.stage} checkpoint", self.ranks, step, params,
                         groups, ADAM_STATE, ("step",), buffer_info, loss_scaler, self.stage, list(module))
        self.m["global_steps"] = model.get("global_steps")
        self.m["lr_scheduler"] = self.lr_scheduler  # the scheduler's state_dict when DeepSpeed was handed one

    # ------------------------------------------------------------------------------------------ files
    def open_file(self, fname: str) -> Any:
        """The file read once, memory-mapped, with no code run from it."""
        if fname not in self._files:
            self._files[fname] = read_deepspeed_file(os.path.join(self.folder, fname), self.trust, mmap=True)
        return self._files[fname]

    def close(self) -> None:
        self._files.clear()

    def _optim(self, rank: int) -> Dict[str, Any]:
        return self.open_file(_optim_file(self.folder, rank))["optimizer_state_dict"]

    def files_for(self, name: str, lo: int, hi: int) -> List[str]:
        if not self.by_name[name].trainable:
            return [_model_states_file(self.folder, r) or self.model_file for r in range(self.ranks)] \
                if self.stage == 3 else [self.model_file]
        return [_optim_file(self.folder, r) for r, off, plo, n in self._pieces[self.by_name[name].name]
                if plo < hi and plo + n > lo]

    # ------------------------------------------------------------------------------------------ layout
    def _flat_sizes(self, rank: int) -> List[int]:
        """Rank `rank`'s flat fp32 tensors' sizes (per group at stages 1-2, per sub-group at stage 3)."""
        key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        flats = self._optim(rank).get(key)
        if not isinstance(flats, (list, tuple)) or not all(torch.is_tensor(t) for t in flats):
            raise CheckpointError(f"{self.folder}/{_optim_file(self.folder, rank)} has no {key}: damaged, or not "
                                  f"a ZeRO-{self.stage} checkpoint")
        return [t.numel() for t in flats]

    def _layout(self, params: List[ParamInfo], shapes: List[Dict[str, Any]]) -> None:
        trainable = [p for p in params if p.trainable]
        sizes = [self._flat_sizes(r) for r in range(self.ranks)]
        if self.stage == 3:
            offset = 0
            for p in trainable:
                part = -(-p.numel // self.ranks)
                self._pieces[p.name] = [(r, offset, r * part, min(part, p.numel - r * part))
                                        for r in range(self.ranks) if r * part < p.numel]
                offset += part
            for r, s in enumerate(sizes):
                if sum(s) != offset:
                    raise CheckpointError(
                        f"{self.folder}/{_optim_file(self.folder, r)}: its flat groups hold {sum(s)} elements but "
                        f"param_shapes need {offset} per rank at {self.ranks} ranks: the model-states and optimizer "
                        f"files are from different runs")
            return
        if any(len(s) != len(shapes) for s in sizes):
            raise CheckpointError(f"{self.folder}: the optimizer files hold {len(sizes[0])} parameter groups, "
                                  f"param_shapes {len(shapes)}: files from different runs")
        bases = [0] * self.ranks  # where group gi starts in each rank's concatenated flat tensors
        for gi, group in enumerate(shapes):
            # rank r holds [starts[r], starts[r] + parts[r]) of the group's flat space (BF16_Optimizer leaves the
            # last rank's partition short instead of padding it)
            parts = [s[gi] for s in sizes]
            starts = [sum(parts[:r]) for r in range(self.ranks)]
            offset = 0
            for p in (q for q in trainable if q.group == gi):
                pieces = []
                for r in range(self.ranks):
                    a, b = max(offset, starts[r]), min(offset + p.numel, starts[r] + parts[r])
                    if a < b:
                        pieces.append((r, bases[r] + a - starts[r], a - offset, b - a))
                self._pieces[p.name] = pieces
                offset += p.numel
            if offset > sum(parts):
                raise CheckpointError(f"{self.folder}: parameter group {gi} needs {offset} elements, its "
                                      f"{self.ranks} partitions hold {sum(parts)}: files from different runs")
            self._check_mappings(gi, group, bases)
            bases = [b + n for b, n in zip(bases, parts)]

    def _check_mappings(self, gi: int, group: Dict[str, Any], bases: List[int]) -> None:
        """Stages 1-2: the file's own fragment records must match the layout read from param_shapes."""
        for r in range(self.ranks):
            mappings = self._optim(r).get("param_slice_mappings")
            if not mappings or gi >= len(mappings):
                continue
            for name, frag in mappings[gi].items():
                pieces = [(off - bases[r], n) for rank, off, _, n in self._pieces.get(name, ()) if rank == r]
                if (getattr(frag, "start", None), getattr(frag, "numel", None)) not in [(o, n) for o, n in pieces]:
                    raise CheckpointError(
                        f"{self.folder}/{_optim_file(self.folder, r)}: parameter {name} lies at "
                        f"{getattr(frag, 'start', '?')}+{getattr(frag, 'numel', '?')} of the rank's partition, the "
                        f"layout from param_shapes puts it at {pieces}: a partition layout hf_zero does not read")

    def _param_groups(self, first: Dict[str, Any], params: List[ParamInfo], count: int) -> List[Dict[str, Any]]:
        """The user's parameter groups' hyper-parameters (stage 3 saves one per sub-group: the first of each)."""
        inner = first.get("optimizer_state_dict") if self.stage == 3 else first.get("base_optimizer_state")
        saved = inner.get("param_groups") if isinstance(inner, dict) else None
        if not saved:
            return [{} for _ in range(count)]
        if self.stage == 3 and len(saved) != count:
            saved = self._first_sub_groups(saved, params, count)
        return [{k: json_value(v) for k, v in g.items() if k in HYPER_PARAMETERS} for g in saved]

    def _first_sub_groups(self, saved: List[Dict[str, Any]], params: List[ParamInfo],
                          count: int) -> List[Dict[str, Any]]:
        """Stage 3 splits a parameter group into sub-groups; the flat sizes say where each group starts."""
        per_group = [0] * count
        for p in (q for q in params if q.trainable):
            per_group[p.group] += -(-p.numel // self.ranks)
        sizes, out, i = self._flat_sizes(0), [], 0
        for total in per_group:
            out.append(saved[i])
            while total > 0 and i < len(sizes):
                total -= sizes[i]
                i += 1
        return out

    # ------------------------------------------------------------------------------------------ reads
    def _rank_tensors(self, rank: int, kind: str) -> Optional[List[torch.Tensor]]:
        opt = self._optim(rank)
        if kind == "values":
            return list(opt["fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"])
        key = kind.split(".", 1)[1]
        state = self._state(rank)
        if not state:
            return None
        tensors = [state[i].get(key) if i in state else None for i in sorted(state)]
        if any(t is None for t in tensors):
            return None
        return tensors

    def _state(self, rank: int) -> Dict[int, Dict[str, Any]]:
        """The rank's optimizer state per group (stages 1-2) or sub-group (stage 3), by index."""
        opt = self._optim(rank)
        inner = opt.get("optimizer_state_dict") if self.stage == 3 else opt.get("base_optimizer_state")
        if isinstance(inner, list):  # non-elastic stages 1-2 in older DeepSpeed: a list of per-group states
            return dict(enumerate(inner))
        return (inner.get("state") if isinstance(inner, dict) else None) or {}

    def _flat_of(self, rank: int, kind: str) -> Optional[List[Tuple[int, torch.Tensor]]]:
        tensors = self._rank_tensors(rank, kind)
        if tensors is None:
            return None
        out, start = [], 0
        for t in tensors:
            out.append((start, t.reshape(-1)))
            start += t.numel()
        return out

    def _read(self, p: ParamInfo, kind: str, lo: int, hi: int) -> Optional[torch.Tensor]:
        if not p.trainable:
            return self._frozen(p).reshape(-1)[lo:hi].to(torch.float32)
        parts = []
        for rank, off, plo, n in self._pieces[p.name]:
            a, b = max(lo, plo), min(hi, plo + n)
            if a >= b:
                continue
            flats = self._flat_of(rank, kind)
            if flats is None:
                return None
            start = off + a - plo
            for begin, t in flats:  # the piece may cross sub-group tensors
                if start >= begin + t.numel() or a >= b:
                    continue
                take = min(b - a, begin + t.numel() - start)
                parts.append(t[start - begin:start - begin + take].to(torch.float32))
                a, start = a + take, start + take
        return torch.cat(parts) if parts else torch.empty(0)

    def _scalar(self, p: ParamInfo, key: str) -> Optional[float]:
        """`key` (Adam's step) of the group or sub-group whose flat tensor holds the parameter's first piece."""
        rank, off, _, _ = self._pieces[p.name][0]
        state = self._state(rank)
        start = 0
        for i, t in enumerate(self._rank_tensors(rank, "values") or []):
            if start <= off < start + t.numel():
                value = (state.get(i) or {}).get(key)
                return float(value) if value is not None else None
            start += t.numel()
        return None

    def _frozen(self, p: ParamInfo) -> torch.Tensor:
        if self.stage != 3:
            fragments = self.open_file(self.model_file).get("frozen_param_fragments") or {}
            if p.name not in fragments:
                raise CheckpointError(f"{self.folder}/{self.model_file} lacks frozen parameter {p.name}")
            return fragments[p.name]
        parts = []
        for r in range(self.ranks):
            fname = _model_states_file(self.folder, r)
            fragments = (self.open_file(fname).get("frozen_param_fragments") or {}) if fname else {}
            if p.name not in fragments:
                raise CheckpointError(f"{self.folder}: rank {r}'s model states lack frozen parameter {p.name}")
            parts.append(fragments[p.name].reshape(-1))
        return torch.cat(parts)[:p.numel]

    def _buffer(self, name: str) -> torch.Tensor:
        return self.open_file(self.model_file)["module"][name]

