"""The wheel is the library (issue 33): `pip wheel .` packages hf_zero/ and nothing of benchmarks/ (what needs root:
the namespace hosts, their link and process helpers, the capacity table, the two-host bench), `import hf_zero` and
`import hf_zero.tools.bench` load none of it, and the old module paths raise an ImportError that names the new
place. The wheel is built from a copy of the checkout's packaging files (a few seconds; no processes but pip's),
so no stale build/ folder of the checkout can hide or add a file."""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# module path -> where it went (each old path is a stub that raises ImportError naming it)
MOVED = {"hf_zero.tools.hosts": "benchmarks/hosts.py", "hf_zero.tools.link": "benchmarks/link.py",
         "hf_zero.tools.procs": "benchmarks/procs.py", "hf_zero.tools.bench.capacity": "benchmarks/capacity/",
         "hf_zero.tools.bench.capacity.cli": "benchmarks/capacity/",
         "hf_zero.tools.bench.multihost": "benchmarks/two_hosts.py"}
STUBS = ["hf_zero/tools/hosts.py", "hf_zero/tools/link.py", "hf_zero/tools/procs.py", "hf_zero/tools/bench/capacity.py",
         "hf_zero/tools/bench/multihost.py"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(the wheel's file names, its METADATA) of `pip wheel --no-deps --no-build-isolation` over a copy of the
    packaging files, hf_zero/ and benchmarks/."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("hf_zero", "benchmarks"):
        shutil.copytree(os.path.join(ROOT, folder), src / folder, ignore=ignore)
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "--disable-pip-version-check", "-w", str(tmp / "out"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = (tmp / "out").glob("hf_zero-*.whl")
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        stubs = {n: z.read(n).decode() for n in names if n in STUBS}
    return names, metadata, stubs


def test_the_wheel_holds_hf_zero_and_nothing_of_benchmarks(wheel):
    names, _, stubs = wheel
    assert "hf_zero/__init__.py" in names and "hf_zero/tools/bench/cli.py" in names
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"hf_zero"}, sorted(tops)
    assert not [n for n in names if n.startswith("benchmarks/") or "/capacity/" in n], names
    # the old paths of the moved modules are stubs only: a few lines that raise ImportError naming the new place
    assert sorted(stubs) == sorted(STUBS), sorted(stubs)
    for name, text in stubs.items():
        assert len(text) < 800 and "raise ImportError" in text and "moved to benchmarks/" in text, (name, text)
        assert "\nimport" not in text and "\nfrom" not in text and "def " not in text, (name, text)


def test_datasets_is_an_extra_and_deepspeed_is_pinned(wheel):
    """hf_zero never imports datasets: only the example (and the tests) need it; the LoRA example's TRL and PEFT
    are an extra; bench pins DeepSpeed as CI runs it."""
    _, metadata, _ = wheel
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    plain = [r for r in requires if "extra ==" not in r]
    assert not [r for r in plain if r.startswith("datasets")], plain
    assert {r.split(";")[0].strip() for r in plain} >= {"torch>=2.9.1", "accelerate>=1.13.0", "transformers>=5.1.0"}

    def extra(name):
        return sorted(r.split(";")[0].strip() for r in requires if r.endswith(f'extra == "{name}"'))

    assert "datasets>=3.0.0" in extra("example") and "datasets>=3.0.0" in extra("test")
    assert extra("lora") == ["peft==0.21.2", "trl==1.16.0"]
    assert {"peft==0.21.2", "trl==1.16.0"} <= set(extra("test"))
    assert "deepspeed==0.19.8" in extra("bench")


def test_importing_hf_zero_loads_nothing_of_benchmarks():
    """`import hf_zero`, `hf_zero.tools.bench` and bench's and hf-zero's command lines load no benchmarks module
    and none of the moved paths, even run from the checkout's root (where `benchmarks` would import)."""
    code = ("import json, sys\nimport hf_zero, hf_zero.tools.bench, hf_zero.tools.bench.cli, hf_zero.cli\n"
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    modules = json.loads(proc.stdout.splitlines()[-1])
    assert not [m for m in modules if m == "benchmarks" or m.startswith("benchmarks.")], modules
    assert not set(MOVED) & set(modules)
    assert "hf_zero.tools.bench.cli" in modules


@pytest.mark.parametrize("name, where", sorted(MOVED.items()))
def test_a_moved_module_path_names_its_new_place(name, where):
    with pytest.raises(ImportError, match=f"moved to {where}.*run from a checkout"):
        importlib.import_module(name)
