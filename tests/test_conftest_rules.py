"""tests/conftest.py's rule (the same for `needs_extras` under HF_ZERO_REQUIRE_EXTRAS_TESTS=1, checked last):
under HF_ZERO_REQUIRE_DEEPSPEED_TESTS=1 (CI) a `needs_deepspeed` test that skips, in its
body or in a fixture, is a failure that keeps the skip's reason; the `needs_root` rule is its own variable's (unset
here: its skip stays a skip, as a `needs_deepspeed` skip does without its variable), an unmarked skip stays a skip,
and an expected failure is not touched.

pytest itself runs the rule: a pytest of its own (one process) over a folder holding a copy of tests/conftest.py and
of pyproject.toml's markers (`--strict-markers`: a marker the rule needs must be declared), read back from its
JUnit XML report.
"""
import os
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CASES = '''
import pytest


@pytest.fixture
def deepspeed():
    pytest.skip("needs DeepSpeed: No module named 'deepspeed' (in a fixture)")


@pytest.mark.needs_deepspeed
def test_ds_skips_in_its_body():
    pytest.skip("needs DeepSpeed: No module named 'deepspeed' (in the body)")


@pytest.mark.needs_deepspeed
def test_ds_skips_in_a_fixture(deepspeed):
    pass


@pytest.mark.needs_deepspeed
def test_ds_runs():
    pass


@pytest.mark.needs_extras
def test_extras_skips():
    pytest.skip("pip install -e '.[notebook]': No module named 'nbclient'")


@pytest.mark.needs_root
def test_root_skips():
    pytest.skip("needs root: not root")


def test_unmarked_skips():
    pytest.skip("optional")


@pytest.mark.needs_deepspeed
@pytest.mark.xfail(reason="known", strict=True)
def test_ds_expected_failure():
    assert False
'''


def _outcomes(tmp_path, env):
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        markers = tomllib.load(f)["tool"]["pytest"]["ini_options"]["markers"]
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n" + "".join(f"    {m}\n" for m in markers))
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--strict-markers",
                          "--junitxml", str(tmp_path / "report.xml"), str(tmp_path / "test_cases.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert (tmp_path / "report.xml").is_file(), res.stdout[-3000:] + res.stderr[-3000:]
    got = {}
    for case in ET.parse(tmp_path / "report.xml").iter("testcase"):
        kinds = [(child.tag, child.get("message", "")) for child in case if child.tag in ("failure", "error",
                                                                                           "skipped")]
        got[case.get("name")] = kinds[0] if kinds else ("passed", "")
    return got


def test_a_needs_deepspeed_skip_fails_under_its_variable_and_nothing_else_changes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_ZERO_REQUIRE_")}
    env.update(HF_ZERO_REQUIRE_DEEPSPEED_TESTS="1", PYTHONPATH=ROOT)
    got = _outcomes(tmp_path, env)
    body, fixture = got.pop("test_ds_skips_in_its_body"), got.pop("test_ds_skips_in_a_fixture")
    assert body[0] == "failure", body
    assert fixture[0] == "error", fixture  # a fixture's failure is reported as an error of the setup
    for kind, message in (body, fixture):
        assert "needs DeepSpeed and skipped under HF_ZERO_REQUIRE_DEEPSPEED_TESTS=1" in message, message
    assert "No module named 'deepspeed' (in the body)" in body[1] and "(in a fixture)" in fixture[1]
    assert got == {"test_ds_runs": ("passed", ""),
                   "test_extras_skips": ("skipped", "pip install -e '.[notebook]': No module named 'nbclient'"),
                   "test_root_skips": ("skipped", "needs root: not root"),
                   "test_unmarked_skips": ("skipped", "optional"),
                   "test_ds_expected_failure": ("skipped", "known")}, got


def test_a_needs_extras_skip_fails_under_its_own_variable_only(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_ZERO_REQUIRE_")}
    env.update(HF_ZERO_REQUIRE_EXTRAS_TESTS="1", PYTHONPATH=ROOT)
    got = _outcomes(tmp_path, env)
    kind, message = got.pop("test_extras_skips")
    assert kind == "failure", (kind, message)
    assert "needs the notebook / bench extras and skipped under HF_ZERO_REQUIRE_EXTRAS_TESTS=1" in message, message
    assert "No module named 'nbclient'" in message, message
    assert got["test_ds_skips_in_its_body"][0] == "skipped" and got["test_root_skips"][0] == "skipped", got

