"""The private torch names hf_zero uses (docs/architecture.md, "Private APIs still used"), checked against the
installed torch in this process: each exists, and where it is cheap to show, does what hf_zero relies on (a
callback queued from a backward hook runs once the backward is done, the graph task id tells a backward from a
forward, ...).

The names are spread over engine/ and tools/ (the engine imports no adapter: each file uses torch directly), so
this file also reads hf_zero's source: every private torch name reached from a `torch` module path (an attribute
chain, an import, a getattr with a constant name) must be pinned here, or the test names it. Private attributes
of torch objects (a module's `_buffers`, an optimizer's hook dicts, a process group's backend options) cannot be
found that way and are pinned by hand below.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import Any, Set

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hf_zero"

# every private torch name reached from a module path, as hf_zero's source spells it
PINNED = {
    "torch.autograd.Variable._execution_engine.queue_callback",
    "torch._C._current_graph_task_id",
    "torch._C._current_autograd_node",
    "torch._C._autograd._top_saved_tensors_default_hooks",
    "torch._C.DisableTorchFunctionSubclass",
    "torch._C._nn._parse_to",
    "torch.distributed.distributed_c10d._get_default_store",
    "torch.distributed.distributed_c10d._get_default_group",
    "torch.autograd.profiler._is_profiler_enabled",
    "torch.utils._pytree.tree_flatten",
    "torch.utils._pytree.tree_unflatten",
    "torch.utils._pytree.tree_leaves",
    "torch.utils._python_dispatch.TorchDispatchMode",
    "torch._subclasses.fake_tensor.FakeTensor",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch.testing._internal.distributed.fake_pg.FakeStore",
    "torch._dynamo",
    "torch._dynamo.reset",
    "torch._dynamo.utils.counters",
}
# private attributes of torch objects, which no module path reaches (pinned by hand; where: docs/architecture.md)
MODULE_REGISTRIES = ("_parameters", "_buffers", "_non_persistent_buffers_set")


def _private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def torch_private_uses(path: Path) -> Set[str]:
    """Every private torch name the file reaches from a torch module path: the longest attribute chain from a
    name bound to a torch module or object by an import, `from torch... import` and `import torch._x`, and
    getattr/hasattr of a constant private name on such a chain."""
    tree = ast.parse(path.read_text(), str(path))
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    bound[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(node: Any) -> Any:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return ".".join([bound[node.id]] + parts[::-1]) if isinstance(node, ast.Name) and node.id in bound else None

    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            names = [dotted(node)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and _private(str(node.args[1].value)):
            base = dotted(node.args[0])
            names = [f"{base}.{node.args[1].value}"] if base else []
        found.update(n for n in names if n and any(_private(p) for p in n.split(".")))
    return found


def resolve(name: str) -> Any:
    """The object a dotted name means: the longest importable module, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_every_private_torch_name_in_hf_zero_is_pinned():
    used = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in torch_private_uses(path):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert used, "the scan would never fire"
    # prefixes of a pinned name (`torch._dynamo` of `torch._dynamo.reset`) are the same use
    unpinned = {n: where for n, where in used.items() if n not in PINNED and not any(p.startswith(n + ".")
                                                                                        for p in PINNED)}
    assert not unpinned, ("private torch names used but not pinned: add each to PINNED (with a check of what hf_zero "
                          f"relies on) and a row to docs/architecture.md's private-API table: {unpinned}")


def test_the_scan_sees_each_form_of_use(tmp_path):
    src = ("import torch\nimport torch.distributed as dist\nfrom torch.utils._pytree import tree_map\n"
           "from torch.autograd import profiler\nimport torch._dynamo\n"
           "a = torch._C._nn._parse_to\nb = dist.distributed_c10d._get_default_group()\n"
           "c = getattr(torch._C, '_x', None)\nd = profiler._is_profiler_enabled\ne = torch.nn.Linear\n")
    (tmp_path / "m.py").write_text(src)
    assert torch_private_uses(tmp_path / "m.py") == {
        "torch.utils._pytree.tree_map", "torch._dynamo", "torch._C._nn._parse_to", "torch._C",
        "torch.distributed.distributed_c10d._get_default_group", "torch._C._x",
        "torch.autograd.profiler._is_profiler_enabled"}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_each_pinned_name_exists(name):
    assert resolve(name) is not None, f"{name} is gone from torch {torch.__version__}"


# ------------------------------------------------------------------------------------ what hf_zero relies on
def test_autograd_internals_tell_the_backward_apart():
    """queue_callback from a hook inside the backward runs once the backward is done (engine/reducer.py);
    inside the backward the graph task id is set and the current node is the one evaluating
    (engine/gatherer.py, engine/reducer.py); outside, -1 and None."""
    x = torch.randn(3, requires_grad=True)
    events = []

    def hook(grad):
        events.append(("hook", torch._C._current_graph_task_id() != -1, torch._C._current_autograd_node() is not None))
        torch.autograd.Variable._execution_engine.queue_callback(lambda: events.append(("callback",)))
        return grad

    y = x * 2
    y.register_hook(hook)
    y.sum().backward()
    events.append(("after",))
    assert events == [("hook", True, True), ("callback",), ("after",)]
    assert torch._C._current_graph_task_id() == -1 and torch._C._current_autograd_node() is None


def test_the_top_saved_tensors_hooks_are_the_innermost_pair():
    """engine/activations.py reads the saved-tensor hooks active outside its own."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    assert top(False) is None

    def pack(t):
        return t

    def unpack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert top(False) == (pack, unpack)


def test_tensor_internals_partitioned_parameters_use():
    """engine/partitioned.py: `.to()`'s arguments parsed as torch parses them; subclass dispatch switched off."""
    assert torch._C._nn._parse_to("cpu", torch.float16) == (torch.device("cpu"), torch.float16, False, None)
    assert torch._C._nn._parse_to(dtype=torch.float64)[1] is torch.float64

    class Marked(torch.Tensor):
        pass

    t = torch.ones(2).as_subclass(Marked)
    with torch._C.DisableTorchFunctionSubclass():
        assert type(t + 1) is torch.Tensor
    assert type(t + 1) is Marked


def test_the_profiler_flag_follows_the_profiler():
    from torch.autograd import profiler

    assert profiler._is_profiler_enabled is False
    with torch.profiler.profile():
        assert profiler._is_profiler_enabled is True
    assert profiler._is_profiler_enabled is False


def test_an_optimizer_classs_step_is_wrapped_once_and_marked():
    """engine/optimizer.py runs the user's class's update without torch's hook wrapper, which
    `Optimizer._patch_step_function` puts around a class's `step` at the first construction (`profile_hook_step`,
    functools' `__wrapped__`) and marks `hooked`; and gives ZeroOptimizer a step wrapped once and marked, which
    torch then leaves as it is."""

    class Plain(torch.optim.Optimizer):  # its own update (a super().step() would run the base class's wrapper)
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(-group["lr"])

    own = Plain.__dict__["step"]
    calls = []
    opt = Plain([torch.nn.Parameter(torch.zeros(1))])
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    wrapped = Plain.__dict__["step"]
    assert wrapped is not own and getattr(wrapped, "hooked", False) and wrapped.__wrapped__ is own
    opt.step()
    assert calls == ["pre"]
    wrapped.__wrapped__(opt)  # the update alone: no hook
    assert calls == ["pre"] and opt.param_groups[0]["params"][0].item() == pytest.approx(-0.2)  # two updates

    class Marked(torch.optim.SGD):
        pass

    Marked.step = torch.optim.Optimizer.profile_hook_step(torch.optim.SGD.step)
    Marked.step.hooked = True
    before = Marked.__dict__["step"]
    Marked([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert Marked.__dict__["step"] is before  # not wrapped a second time


def test_the_module_registries_hold_parameters_and_buffers():
    """engine/state.py, engine/loading.py, engine/engine.py and the dry run walk a module's own registries."""
    m = torch.nn.Linear(2, 2)
    m.register_buffer("kept", torch.ones(1))
    m.register_buffer("scratch", torch.ones(1), persistent=False)
    assert set(m._parameters) == {"weight", "bias"} and m._parameters["weight"] is m.weight
    assert set(m._buffers) == {"kept", "scratch"} and m._buffers["kept"] is m.kept
    assert m._non_persistent_buffers_set == {"scratch"}
    assert set(m.state_dict()) == {"weight", "bias", "kept"}
    for name in MODULE_REGISTRIES:
        assert hasattr(torch.nn.Module(), name)


def test_the_process_group_timeout_is_where_the_background_save_reads_it():
    """checkpoint/background.py reads the engine's group's collective timeout (tolerantly: without these internals
    it takes new_group's default)."""
    import torch.distributed as dist

    assert callable(getattr(dist.ProcessGroup, "_get_backend", None))
    assert hasattr(dist.ProcessGroupGloo.Options, "_timeout")
