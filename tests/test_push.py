"""`hf-zero push` uploads an export with the real huggingface_hub client, to a local stand-in of the Hub
(tests/hub_server.py). The push runs in a subprocess because huggingface_hub reads HF_ENDPOINT at import.

Two client paths: with the stand-in's default (every file "regular") and hf_xet installed, `upload_folder` takes
huggingface_hub's pipelined Xet upload with only regular files; with `HubServer(lfs_threshold=1024)` and
HF_HUB_DISABLE_XET=1 (hub_server.CLIENT_ENV) it takes `create_commit` with LFS: preupload, the LFS batch API, one PUT
(and verify) per object, and a commit that names the objects by sha256 oid."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import models
from hub_server import CLIENT_ENV, HubServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LFS_THRESHOLD = 1024  # bytes: every safetensors shard of the export (and its index) goes LFS, config.json does not


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


def hub_env(hub, lfs=False, progress=False):
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN="hf_dummy_token", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_HUB_DISABLE_XET", None)
    if not progress:
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    else:
        env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    if lfs:
        env.update(CLIENT_ENV)
    return env


def push(hub, *args, lfs=False, progress=False):
    return subprocess.run([sys.executable, "-m", "hf_zero.cli", "push", *map(str, args)], cwd=ROOT,
                          env=hub_env(hub, lfs, progress), capture_output=True, text=True, timeout=120)


def local_files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def request_kinds(hub):
    """The requests in order, named by endpoint, runs of one kind folded into one: the LFS uploads (a PUT, then a
    verify, per object, in parallel) into one "upload", and the README's validate-yaml, which 2.4's upload_folder
    sends twice on this path (once itself, once in create_commit)."""
    def kind(method, path):
        for suffix, name in (("/objects/batch", "batch"), ("/objects/verify", "upload"), ("/preupload/", "preupload"),
                             ("/commit/", "commit"), ("/api/repos/create", "create"),
                             ("/api/validate-yaml", "validate-yaml"), ("/resolve/", method + " resolve")):
            if suffix in path:
                return name
        return "upload" if method == "PUT" and path.startswith("/_lfs/") else f"{method} {path}"
    out = []
    for method, path in hub.requests:
        k = kind(method, path)
        if not (out and out[-1] == k):
            out.append(k)
    return out


def assert_lfs_commit(hub, repo_id, want, commit):
    """`commit` (an entry of hub.commits) carried every file of `want`: those above the threshold as LFS objects
    whose oid is the sha256 of the local file and of the stored object, the others as regular files; every byte
    of every file arrived."""
    received = hub.repos[repo_id]
    assert sorted(received) == sorted(want)
    for name, data in want.items():
        assert received[name] == data, f"{name} differs after the upload"
    lfs_names = {n for n, d in want.items() if len(d) > LFS_THRESHOLD}
    assert set(commit["lfs"]) == lfs_names and set(commit["regular"]) == set(want) - lfs_names
    assert sum(n.endswith(".safetensors") for n in lfs_names) >= 3 and "config.json" in commit["regular"]
    for name, oid in commit["lfs"].items():
        assert oid == sha256(want[name]) == sha256(hub.lfs_objects[oid]), name
        assert hub.lfs_objects[oid] == want[name], name


def logits_of(model):
    ids = torch.randint(0, models.VOCAB, (2, models.SEQ_LEN), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def test_push_uploads_the_export_byte_for_byte(export_dir):
    """The regular path: the stand-in's default answers "regular" for every file, so no LFS endpoint runs."""
    with HubServer() as hub:
        r = push(hub, export_dir, "me/tiny-gpt2", "--private", "--message", "first export")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "me/tiny-gpt2" in r.stdout
        assert hub.unhandled == [], f"endpoints the stand-in lacks: {hub.unhandled}"
        assert hub.lfs_batches == [] and hub.commits[0]["lfs"] == {}  # the regular path: contents in the commit
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


# ------------------------------------------------------------------------------------------ the LFS path
@pytest.fixture(scope="module")
def lfs_push(export_dir):
    """`hf-zero push` of the export through LFS, progress bars on: (the stand-in after the push, the CLI's
    CompletedProcess, the local files as they were pushed)."""
    want = local_files(export_dir)
    with HubServer(lfs_threshold=LFS_THRESHOLD) as hub:
        r = push(hub, export_dir, "me/tiny-lfs", "--message", "through lfs", lfs=True, progress=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return hub, r, want


def test_push_through_lfs_byte_for_byte_and_same_logits(lfs_push, tmp_path):
    from transformers import AutoModelForCausalLM

    hub, r, want = lfs_push
    assert "me/tiny-lfs" in r.stdout
    assert hub.unhandled == [] and hub.rejected == [], (hub.unhandled, hub.rejected)
    # what the real client sent, in order (huggingface_hub 2.4, hf_xet disabled)
    assert request_kinds(hub) == ["create", "validate-yaml", "preupload", "batch", "upload", "commit"]
    assert len(hub.commits) == 1 and hub.commits[0]["header"]["summary"] == "through lfs"
    commit = hub.commits[0]
    assert_lfs_commit(hub, "me/tiny-lfs", want, commit)
    oids = set(commit["lfs"].values())
    # the batch asked for basic transfer with sha256 oids; one PUT and one verify per object, nothing else stored
    (batch,) = hub.lfs_batches
    assert batch["operation"] == "upload" and batch["hash_algo"] == "sha256" and "basic" in batch["transfers"]
    assert {(o["oid"], o["size"]) for o in batch["objects"]} == {(oid, len(hub.lfs_objects[oid])) for oid in oids}
    assert sorted(hub.lfs_uploads) == sorted(oids) and sorted(hub.lfs_verified) == sorted(oids)
    assert set(hub.lfs_objects) == oids
    puts = [p for m, p in hub.requests if m == "PUT"]
    assert sorted(p.rsplit("/", 1)[1] for p in puts) == sorted(oids)
    # the token goes to the Hub API only, not to the storage URLs the batch handed out
    assert {a for (m, p), a in zip(hub.requests, hub.auth) if m != "PUT"} == {"Bearer hf_dummy_token"}

    # a folder rebuilt from the received files loads to the same model: same logits, exactly
    rebuilt = tmp_path / "rebuilt"
    for name, data in hub.repos["me/tiny-lfs"].items():
        (rebuilt / name).parent.mkdir(parents=True, exist_ok=True)
        (rebuilt / name).write_bytes(data)
    loaded = AutoModelForCausalLM.from_pretrained(rebuilt, attn_implementation="eager")
    torch.testing.assert_close(logits_of(loaded), logits_of(models.make_model("gpt2")), rtol=0, atol=0)


def test_push_shows_upload_progress(lfs_push):
    """huggingface_hub's tqdm bars reach the CLI's stderr: one per LFS file (named by the file, ending at 100%)
    and one over the files."""
    hub, r, want = lfs_push
    lfs_names = sorted(hub.commits[0]["lfs"])
    for name in lfs_names:
        assert f"{os.path.basename(name)}: 100%" in r.stderr, f"no finished progress bar for {name}:\n{r.stderr}"
    assert f"Upload {len(lfs_names)} LFS files: 100%" in r.stderr, r.stderr


PUSH_TWICE = textwrap.dedent("""
    import json, sys
    from hf_zero.checkpoint import push_to_hub
    from huggingface_hub import hf_hub_download

    folder, cache, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    first = push_to_hub(folder, "me/tiny-fn", private=True, commit_message="first")
    paths = {n: hf_hub_download("me/tiny-fn", n, cache_dir=cache) for n in names}
    second = push_to_hub(folder, "me/tiny-fn", commit_message="again")
    print(json.dumps({"first": first.oid, "second": second.oid, "paths": paths}))
""")


def test_push_to_hub_function_through_lfs_resolve_and_dedup(export_dir, tmp_path):
    """hf_zero.checkpoint.push_to_hub (what accelerator.push_to_hub and `hf-zero push` call) through LFS; the files
    come back through resolve with hf_hub_download (HEAD + GET); pushing the same folder again uploads no byte:
    the batch answers that every object is already there and the commit names them by oid."""
    want = local_files(export_dir)
    with HubServer(lfs_threshold=LFS_THRESHOLD) as hub:
        lfs_name = sorted(n for n in want if n.endswith(".safetensors"))[0]
        r = subprocess.run([sys.executable, "-c", PUSH_TWICE, str(export_dir), str(tmp_path / "cache"), lfs_name,
                            "config.json"], cwd=ROOT, env=hub_env(hub, lfs=True), capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert hub.unhandled == [] and hub.rejected == [], (hub.unhandled, hub.rejected)
    assert [c["oid"] for c in hub.commits] == [out["first"], out["second"]]
    assert hub.created[0]["visibility"] == "private"
    for commit in hub.commits:
        assert_lfs_commit(hub, "me/tiny-fn", want, commit)
    assert hub.commits[0]["lfs"] == hub.commits[1]["lfs"]
    for name, path in out["paths"].items():  # resolve serves LFS and regular files
        with open(path, "rb") as f:
            assert f.read() == want[name], name
    assert ("HEAD", f"/me/tiny-fn/resolve/main/{lfs_name}") in hub.requests
    # the second push: a batch whose objects have no actions, so no PUT, no verify
    assert len(hub.lfs_batches) == 2 and len(hub.lfs_uploads) == len(hub.commits[0]["lfs"])
    assert request_kinds(hub) == ["create", "validate-yaml", "preupload", "batch", "upload", "commit",
                                  "HEAD resolve", "GET resolve", "HEAD resolve", "GET resolve",
                                  "create", "validate-yaml", "preupload", "batch", "commit"]


def test_the_stand_in_refuses_bad_lfs_uploads():
    """The checks the LFS path relies on: a PUT must carry the batch's signature and bytes whose sha256 is the oid,
    and a commit may only name an uploaded object (plain urllib, no huggingface_hub)."""
    import urllib.error
    import urllib.request

    def call(method, url, payload=None, data=None):
        body = json.dumps(payload).encode() if payload is not None else data
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body, method=method)) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    good, bad = b"x" * 2000, b"y" * 2000
    oid = sha256(good)
    with HubServer(lfs_threshold=LFS_THRESHOLD) as hub:
        call("POST", f"{hub.url}/api/repos/create", {"name": "r", "organization": "me"})
        code, data = call("POST", f"{hub.url}/api/models/me/r/preupload/main",
                          {"files": [{"path": "big", "size": 2000}, {"path": "small", "size": 10}]})
        assert code == 200 and [f["uploadMode"] for f in json.loads(data)["files"]] == ["lfs", "regular"]
        code, data = call("POST", f"{hub.url}/me/r.git/info/lfs/objects/batch",
                          {"operation": "upload", "transfers": ["basic", "multipart"], "hash_algo": "sha256",
                           "objects": [{"oid": oid, "size": 2000}]})
        assert code == 200 and json.loads(data)["transfer"] == "basic"
        href = json.loads(data)["objects"][0]["actions"]["upload"]["href"]
        assert call("PUT", href.split("?")[0], data=good)[0] == 403      # no signature
        assert call("PUT", href, data=bad)[0] == 400                      # sha256 is not the oid
        assert call("PUT", href, data=good[:-1])[0] == 400                # not the announced size
        commit = "\n".join(json.dumps(x) for x in [{"key": "header", "value": {"summary": "s"}},
                                                   {"key": "lfsFile", "value": {"path": "big", "algo": "sha256",
                                                                                "oid": oid, "size": 2000}}])
        assert call("POST", f"{hub.url}/api/models/me/r/commit/main", data=commit.encode())[0] == 422  # not uploaded
        assert call("PUT", href, data=iter([good[:999], good[999:]]))[0] == 200  # chunked transfer encoding
        assert call("POST", f"{hub.url}/api/models/me/r/commit/main", data=commit.encode())[0] == 200
        assert hub.repos["me/r"] == {"big": good} and hub.commits[-1]["lfs"] == {"big": oid}
        assert len(hub.rejected) == 4 and hub.unhandled == []
