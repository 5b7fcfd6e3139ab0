"""A local stand-in for the parts of the Hugging Face Hub API that `create_repo` + `upload_folder` use.

Stdlib only: `http.server` on 127.0.0.1 (a free port), served from a thread. Every file a commit carries is stored
in `server.repos[repo_id][path]` (bytes), every request in `server.requests`, and anything the server does not
implement answers 404 and is recorded in `server.unhandled`, so a test can say which endpoint a new
huggingface_hub needs.

Endpoints (DESIGN.md section 7): POST /api/repos/create; HEAD|GET /{repo}/resolve/{rev}/{path} (404 unless
committed); POST /api/validate-yaml; POST /api/models/{repo}/preupload/{rev} (uploadMode "regular" for every file);
POST /api/models/{repo}/commit/{rev} (NDJSON with base64 contents; answers commitUrl, commitOid, pullRequestUrl).
"""
from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple
from urllib.parse import unquote, urlparse


class HubServer:
    def __init__(self) -> None:
        self.repos: Dict[str, Dict[str, bytes]] = {}
        self.created: List[dict] = []
        self.commits: List[dict] = []
        self.requests: List[Tuple[str, str]] = []
        self.unhandled: List[Tuple[str, str]] = []
        self.auth: List[Optional[str]] = []
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

    # ------------------------------------------------------------------ request handling
    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _send(self, code: int, payload=None, headers: Optional[dict] = None) -> None:
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _dispatch(self) -> None:
                path = unquote(urlparse(self.path).path)
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
                    if repo_id not in hub.repos:
                        return self._send(404, {"error": f"Repository {repo_id} not found"},
                                          {"X-Error-Code": "RepoNotFound"})
                    if parts[-2] == "preupload":
                        files = json.loads(body or b"{}").get("files", [])
                        return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                           "shouldIgnore": False} for f in files]})
                    return self._commit(repo_id, body)
                if self.command in ("HEAD", "GET") and "resolve" in parts:
                    i = parts.index("resolve")
                    repo_id, file_path = "/".join(parts[:i]), "/".join(parts[i + 2:])
                    content = hub.repos.get(repo_id, {}).get(file_path)
                    if content is None:
                        return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(content)))
                    self.send_header("ETag", hashlib.sha1(content).hexdigest())
                    self.end_headers()
                    if self.command == "GET":
                        self.wfile.write(content)
                    return None
                hub.unhandled.append((self.command, path))
                return self._send(404, {"error": f"hub_server does not implement {self.command} {path}"})

            def _commit(self, repo_id: str, body: bytes) -> None:
                header, files = None, {}
                for line in body.decode().splitlines():
                    if not line.strip():
                        continue
                    item = json.loads(line)
                    if item["key"] == "header":
                        header = item["value"]
                    elif item["key"] == "file":
                        v = item["value"]
                        if v.get("encoding", "base64") != "base64":
                            return self._send(400, {"error": f"unsupported encoding {v.get('encoding')}"})
                        files[v["path"]] = base64.b64decode(v["content"])
                    else:  # lfsFile / deletedFile / ...: this server only takes regular uploads
                        return self._send(400, {"error": f"unsupported commit operation {item['key']}"})
                hub.repos[repo_id].update(files)
                oid = hashlib.sha1(body).hexdigest()
                hub.commits.append({"repo_id": repo_id, "header": header, "files": sorted(files)})
                return self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                                        "pullRequestUrl": None})

            def do_GET(self) -> None:
                self._dispatch()

            def do_HEAD(self) -> None:
                self._dispatch()

            def do_POST(self) -> None:
                self._dispatch()

            def do_PUT(self) -> None:
                self._dispatch()

        return Handler
