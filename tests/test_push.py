"""`hf-zero push` uploads an export with the real huggingface_hub client, to a local stand-in of the Hub
(tests/hub_server.py). The push runs in a subprocess because huggingface_hub reads HF_ENDPOINT at import."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import models
from hub_server import HubServer


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """A tiny GPT-2 exported by a one-process engine (sharded layout, so several files), plus a README."""
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import export_pretrained

    model = models.make_model("gpt2")
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=2))
    out = tmp_path_factory.mktemp("push") / "export"
    export_pretrained(engine, out, max_shard_size="20KB", progress=False)
    engine.close()
    (out / "README.md").write_text("---\nlicense: apache-2.0\n---\n# tiny\n")
    return out


def push(hub, *args):
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN="hf_dummy_token", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.run([sys.executable, "-m", "hf_zero.cli", "push", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def local_files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_uploads_the_export_byte_for_byte(export_dir):
    with HubServer() as hub:
        r = push(hub, export_dir, "me/tiny-gpt2", "--private", "--message", "first export")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "me/tiny-gpt2" in r.stdout
        assert hub.unhandled == [], f"endpoints the stand-in lacks: {hub.unhandled}"
        assert hub.created == [{"name": "tiny-gpt2", "organization": "me", "visibility": "private", "type": "model"}]
        assert [c["header"]["summary"] for c in hub.commits] == ["first export"]
        assert set(hub.auth) == {"Bearer hf_dummy_token"}
        want = local_files(export_dir)
        assert sorted(want) == sorted(hub.repos["me/tiny-gpt2"])
        assert any(f.startswith("model-00001-of-") for f in want) and "model.safetensors.index.json" in want
        for name, data in want.items():
            assert hub.repos["me/tiny-gpt2"][name] == data, f"{name} differs after the upload"

        # pushing again to the existing repository (create_repo(exist_ok=True)) commits the new contents
        (export_dir / "README.md").write_text("# tiny, take 2\n")
        r = push(hub, export_dir, "me/tiny-gpt2")
        assert r.returncode == 0, r.stdout + r.stderr
        assert len(hub.commits) == 2 and hub.commits[1]["header"]["summary"].startswith("Upload model")
        assert hub.repos["me/tiny-gpt2"]["README.md"] == b"# tiny, take 2\n"


def test_push_refuses_a_training_checkpoint(tmp_path):
    from hf_zero.checkpoint import CheckpointError, push_to_hub

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError, match="export it first"):
        push_to_hub(tmp_path / "ckpt", "me/x")
    with pytest.raises(FileNotFoundError):
        push_to_hub(tmp_path / "missing", "me/x")
    with HubServer() as hub:  # the CLI says so and exits 1, nothing reaches the Hub
        r = push(hub, tmp_path / "ckpt", "me/x")
        assert r.returncode == 1 and "export it first" in r.stderr
        assert hub.requests == []
