"""A local stand-in for the parts of the Hugging Face Hub API that `create_repo` + `upload_folder` use.

Stdlib only: `http.server` on 127.0.0.1 (a free port), served from a thread. Every file a commit carries is stored
in `server.repos[repo_id][path]` (bytes), every request in `server.requests` (with its Authorization header at the
same index of `server.auth`), and anything the server does not implement answers 404 and is recorded in
`server.unhandled`, so a test can say which endpoint a new huggingface_hub needs.

Endpoints (the team design notes, "Facts about this environment"):
  POST /api/repos/create
  POST /api/validate-yaml
  POST /api/models/{repo}/preupload/{rev}      uploadMode "lfs" for files larger than `lfs_threshold` bytes
                                               (None: "regular" for every file), "regular" for the others
  POST /{repo}.git/info/lfs/objects/batch      LFS batch API, "basic" transfer only: one PUT URL per object on this
                                               server (no actions for an object already stored), plus a verify URL
  PUT  /_lfs/{repo}/{oid}?sig=...              the object's bytes (what S3 takes on the real Hub, unauthenticated:
                                               the signature in the URL is the credential); the sha256 of the bytes
                                               must be the oid and their length the size announced in the batch
  POST /{repo}.git/info/lfs/objects/verify     {"oid", "size"}: 200 if that object is stored
  POST /api/models/{repo}/commit/{rev}         NDJSON: "file" (base64 contents) and "lfsFile" (algo sha256, oid, size:
                                               an object uploaded before) operations; answers commitUrl, commitOid,
                                               pullRequestUrl
  HEAD|GET /{repo}/resolve/{rev}/{path}        404 unless committed; X-Repo-Commit, ETag (git sha1, or the sha256 of
                                               an LFS file, with X-Linked-Etag / X-Linked-Size as the Hub sends)

What the LFS objects went through is in `server.lfs_objects` (oid -> bytes), `server.lfs_batches` (the batch
request bodies), `server.lfs_uploads` (oids PUT), `server.lfs_verified` (oids verified) and, per commit,
`server.commits[i]["lfs"]` (path -> oid). Requests the server refused (a bad sha256, an unknown oid, ...) are in
`server.rejected` as (method, path, reason).

Xet: huggingface_hub >= 1.0 uploads the files that preupload calls "lfs" through Xet whenever `hf_xet` is installed,
a choice made on the client (`huggingface_hub.utils.is_xet_available()`), not advertised by the server, and the
client does not fall back to LFS. This server does not speak Xet (its xet-write-token endpoint answers 404 and is
recorded in `unhandled`): a client that should take the LFS path needs HF_HUB_DISABLE_XET=1 (`CLIENT_ENV`).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import parse_qs, unquote, urlparse

# what a huggingface_hub client needs in its environment to talk LFS (not Xet) to this server
CLIENT_ENV = {"HF_HUB_DISABLE_XET": "1"}

_OID = re.compile(r"^[0-9a-f]{64}$")
_LFS_SUFFIX = ".git/info/lfs/objects/"


def git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class HubServer:
    def __init__(self, lfs_threshold: Optional[int] = None) -> None:
        """`lfs_threshold`: preupload answers "lfs" for a file of more than this many bytes (None: never)."""
        self.lfs_threshold = lfs_threshold
        self.repos: Dict[str, Dict[str, bytes]] = {}
        self.lfs_paths: Dict[str, Dict[str, str]] = {}   # repo_id -> path -> oid, for the files committed as LFS
        self.heads: Dict[str, str] = {}                   # repo_id -> oid of its last commit
        self.created: List[dict] = []
        self.commits: List[dict] = []
        self.requests: List[Tuple[str, str]] = []
        self.unhandled: List[Tuple[str, str]] = []
        self.rejected: List[Tuple[str, str, str]] = []
        self.auth: List[Optional[str]] = []
        self.lfs_objects: Dict[str, bytes] = {}
        self.lfs_batches: List[dict] = []
        self.lfs_uploads: List[str] = []
        self.lfs_verified: List[str] = []
        self._announced: Dict[Tuple[str, str], int] = {}  # (repo_id, oid) -> size, handed an upload URL
        self._secret = secrets.token_bytes(16)
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def _sig(self, repo_id: str, oid: str) -> str:
        return hmac.new(self._secret, f"{repo_id}/{oid}".encode(), hashlib.sha256).hexdigest()

    def upload_mode(self, size: int) -> str:
        return "lfs" if self.lfs_threshold is not None and size > self.lfs_threshold else "regular"

    # ------------------------------------------------------------------ request handling
    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def _body(self) -> bytes:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()  # the CRLF after the chunk
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _send(self, code: int, payload=None, headers: Optional[dict] = None,
                      content_type: str = "application/json") -> None:
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _reject(self, code: int, path: str, reason: str, headers: Optional[dict] = None) -> None:
                hub.rejected.append((self.command, path, reason))
                return self._send(code, {"error": reason}, headers)

            def _repo_missing(self, repo_id: str) -> bool:
                if repo_id in hub.repos:
                    return False
                self._send(404, {"error": f"Repository {repo_id} not found"}, {"X-Error-Code": "RepoNotFound"})
                return True

            def _dispatch(self) -> None:
                url = urlparse(self.path)
                path = unquote(url.path)
                body = self._body() if self.command in ("POST", "PUT") else b""
                hub.requests.append((self.command, path))
                hub.auth.append(self.headers.get("Authorization"))
                parts = path.strip("/").split("/")
                if self.command == "POST" and path == "/api/repos/create":
                    req = json.loads(body or b"{}")
                    repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
                    hub.created.append(req)
                    hub.repos.setdefault(repo_id, {})
                    return self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})
                if self.command == "POST" and path == "/api/validate-yaml":
                    return self._send(200, {"errors": [], "warnings": []})
                if self.command == "POST" and len(parts) >= 6 and parts[:2] == ["api", "models"] \
                        and parts[-2] in ("preupload", "commit"):
                    repo_id = "/".join(parts[2:-2])
                    if self._repo_missing(repo_id):
                        return None
                    if parts[-2] == "preupload":
                        files = json.loads(body or b"{}").get("files", [])
                        return self._send(200, {"files": [{"path": f["path"], "uploadMode": hub.upload_mode(f["size"]),
                                                           "shouldIgnore": False} for f in files]})
                    return self._commit(repo_id, path, body)
                if self.command == "POST" and _LFS_SUFFIX in path and parts[-1] in ("batch", "verify"):
                    repo_id = path[1:path.index(_LFS_SUFFIX)]
                    if self._repo_missing(repo_id):
                        return None
                    if parts[-1] == "batch":
                        return self._lfs_batch(repo_id, path, body)
                    return self._lfs_verify(repo_id, path, body)
                if self.command == "PUT" and len(parts) >= 3 and parts[0] == "_lfs":
                    return self._lfs_put(repo_id="/".join(parts[1:-1]), oid=parts[-1], path=path,
                                         sig=parse_qs(url.query).get("sig", [""])[0], body=body)
                if self.command in ("HEAD", "GET") and "resolve" in parts:
                    return self._resolve(parts)
                if self.command == "GET" and len(parts) >= 5 and parts[-2] == "xet-write-token":
                    hub.unhandled.append((self.command, path))
                    return self._send(404, {"error": "hub_server does not speak Xet: run the client with "
                                                     "HF_HUB_DISABLE_XET=1 to upload through LFS"})
                hub.unhandled.append((self.command, path))
                return self._send(404, {"error": f"hub_server does not implement {self.command} {path}"})

            # ---------------------------------------------------------- LFS
            def _lfs_batch(self, repo_id: str, path: str, body: bytes) -> None:
                req = json.loads(body or b"{}")
                hub.lfs_batches.append(req)
                if req.get("operation") != "upload":
                    return self._reject(422, path, f"operation {req.get('operation')!r} is not supported")
                if req.get("hash_algo", "sha256") != "sha256":
                    return self._reject(422, path, f"hash_algo {req.get('hash_algo')!r} is not supported")
                if "basic" not in req.get("transfers", ["basic"]):
                    return self._reject(422, path, f"no transfer this server speaks in {req.get('transfers')}")
                objects = []
                for obj in req.get("objects", []):
                    oid, size = obj.get("oid"), obj.get("size")
                    if not (isinstance(oid, str) and _OID.match(oid) and isinstance(size, int) and size >= 0):
                        hub.rejected.append((self.command, path, f"bad object {obj}"))
                        objects.append({"oid": str(oid), "size": size if isinstance(size, int) else 0,
                                        "error": {"code": 422, "message": "oid must be a sha256, size an int"}})
                        continue
                    out = {"oid": oid, "size": size, "authenticated": True}
                    stored = hub.lfs_objects.get(oid)
                    if stored is None or len(stored) != size:  # else: already there, no actions
                        with hub._lock:
                            hub._announced[(repo_id, oid)] = size
                        out["actions"] = {
                            "upload": {"href": f"{hub.url}/_lfs/{repo_id}/{oid}?sig={hub._sig(repo_id, oid)}",
                                       "header": {}},  # a "chunk_size" header would ask for multipart: never
                            "verify": {"href": f"{hub.url}/{repo_id}.git/info/lfs/objects/verify", "header": {}},
                        }
                    objects.append(out)
                return self._send(200, {"transfer": "basic", "objects": objects},
                                  content_type="application/vnd.git-lfs+json")

            def _lfs_put(self, repo_id: str, oid: str, path: str, sig: str, body: bytes) -> None:
                if not hmac.compare_digest(sig, hub._sig(repo_id, oid)):
                    return self._reject(403, path, "bad or missing signature: not a URL the batch handed out")
                size = hub._announced.get((repo_id, oid))
                if size is None:
                    return self._reject(404, path, f"{oid} was not announced in a batch request")
                if len(body) != size:
                    return self._reject(400, path, f"{oid}: received {len(body)} bytes, the batch announced {size}")
                digest = hashlib.sha256(body).hexdigest()
                if digest != oid:
                    return self._reject(400, path, f"sha256 of the received bytes is {digest}, not the oid {oid}")
                with hub._lock:
                    hub.lfs_objects[oid] = body
                    hub.lfs_uploads.append(oid)
                return self._send(200, None, {"ETag": f'"{hashlib.md5(body).hexdigest()}"'})

            def _lfs_verify(self, repo_id: str, path: str, body: bytes) -> None:
                req = json.loads(body or b"{}")
                stored = hub.lfs_objects.get(req.get("oid"))
                if stored is None or len(stored) != req.get("size"):
                    return self._reject(404, path, f"object {req.get('oid')} of size {req.get('size')} is not stored")
                hub.lfs_verified.append(req["oid"])
                return self._send(200, {"message": "ok"}, content_type="application/vnd.git-lfs+json")

            # ---------------------------------------------------------- commit and download
            def _commit(self, repo_id: str, path: str, body: bytes) -> None:
                header, files, lfs = None, {}, {}
                for line in body.decode().splitlines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    v = item.get("value", {})
                    if item["key"] == "header":
                        header = v
                    elif item["key"] == "file":
                        if v.get("encoding", "base64") != "base64":
                            return self._reject(400, path, f"unsupported encoding {v.get('encoding')}")
                        files[v["path"]] = base64.b64decode(v["content"])
                    elif item["key"] == "lfsFile":
                        if v.get("algo") != "sha256":
                            return self._reject(400, path, f"{v.get('path')}: unsupported algo {v.get('algo')!r}")
                        content = hub.lfs_objects.get(v.get("oid"))
                        if content is None:
                            return self._reject(422, path, f"{v.get('path')}: LFS object {v.get('oid')} was never "
                                                           "uploaded")
                        if len(content) != v.get("size"):
                            return self._reject(422, path, f"{v.get('path')}: size {v.get('size')} but the object "
                                                           f"has {len(content)} bytes")
                        files[v["path"]] = content
                        lfs[v["path"]] = v["oid"]
                    else:  # deletedFile / deletedFolder / copies: not implemented
                        return self._reject(400, path, f"unsupported commit operation {item['key']}")
                oid = hashlib.sha1(body).hexdigest()
                with hub._lock:
                    hub.repos[repo_id].update(files)
                    paths = hub.lfs_paths.setdefault(repo_id, {})
                    for name in files:
                        paths.pop(name, None)
                    paths.update(lfs)
                    hub.heads[repo_id] = oid
                    hub.commits.append({"repo_id": repo_id, "header": header, "files": sorted(files),
                                        "regular": sorted(set(files) - set(lfs)), "lfs": lfs, "oid": oid})
                return self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                                        "pullRequestUrl": None})

            def _resolve(self, parts: List[str]) -> None:
                i = parts.index("resolve")
                repo_id, file_path = "/".join(parts[:i]), "/".join(parts[i + 2:])
                content = hub.repos.get(repo_id, {}).get(file_path)
                if content is None:
                    return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                lfs_oid = hub.lfs_paths.get(repo_id, {}).get(file_path)
                self.send_response(200)
                self.send_header("Content-Length", str(len(content)))
                self.send_header("X-Repo-Commit", hub.heads.get(repo_id, "0" * 40))
                if lfs_oid is None:
                    self.send_header("ETag", f'"{git_blob_sha1(content)}"')
                else:
                    self.send_header("ETag", f'"{lfs_oid}"')
                    self.send_header("X-Linked-Etag", f'"{lfs_oid}"')
                    self.send_header("X-Linked-Size", str(len(content)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(content)
                return None

            def do_GET(self) -> None:
                self._dispatch()

            def do_HEAD(self) -> None:
                self._dispatch()

            def do_POST(self) -> None:
                self._dispatch()

            def do_PUT(self) -> None:
                self._dispatch()

        return Handler
