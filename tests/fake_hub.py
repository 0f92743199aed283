"""A minimal in-memory Hugging Face Hub HTTP server on 127.0.0.1 for push/pull round trips (no network).

Implements what ``huggingface_hub`` 2.x needs for ``create_repo``, ``upload_folder`` / ``push_to_hub`` (every
file uploaded inline: ``uploadMode: regular``, no LFS/Xet) and ``from_pretrained`` / ``hf_hub_download``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

REPO = r"(?P<repo>[^/]+/[^/]+)"


class FakeHub:
    """In-memory repos: ``{repo_id: {"files": {path: bytes}, "sha": str}}``; ``requests`` logs every call."""

    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def commit(self, repo: str, files: dict[str, bytes], deleted: list[str]) -> str:
        entry = self.repos.setdefault(repo, {"files": {}, "sha": "0" * 40})
        entry["files"].update(files)
        for path in deleted:
            entry["files"].pop(path, None)
        digest = hashlib.sha1(entry["sha"].encode() + json.dumps(sorted(entry["files"])).encode())
        entry["sha"] = digest.hexdigest()
        return entry["sha"]


def _handler_class(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _send(
            self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False
        ) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, obj, headers: dict | None = None) -> None:
            self._send(
                status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})}
            )

        def _not_found(self, code: str = "RepoNotFound", head: bool = False) -> None:
            body = json.dumps({"error": f"{code}: {self.path}"}).encode()
            self._send(404, body, {"X-Error-Code": code, "Content-Type": "application/json"}, head)

        def do_HEAD(self) -> None:
            hub.requests.append(f"HEAD {self.path}")
            self._resolve(head=True)

        def do_GET(self) -> None:
            hub.requests.append(f"GET {self.path}")
            path = urlparse(self.path).path
            match = re.fullmatch(rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", path)
            if match:
                return self._model_info(unquote(match["repo"]))
            match = re.fullmatch(rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/.*)?", path)
            if match:
                return self._tree(unquote(match["repo"]))
            self._resolve(head=False)

        def do_POST(self) -> None:
            hub.requests.append(f"POST {self.path}")
            path, body = urlparse(self.path).path, self._body()
            if path == "/api/repos/create":
                data = json.loads(body or b"{}")
                repo = (
                    f"{data.get('organization') or 'user'}/{data['name']}"
                    if "/" not in data["name"]
                    else data["name"]
                )
                hub.repos.setdefault(repo, {"files": {}, "sha": "0" * 40})
                return self._json(200, {"url": f"{hub.url}/{repo}", "name": repo, "id": repo})
            if path == "/api/validate-yaml":
                return self._json(200, {"errors": [], "warnings": []})
            match = re.fullmatch(rf"/api/models/{REPO}/preupload/(?P<rev>[^/]+)", path)
            if match:
                files = json.loads(body)["files"]
                modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]
                return self._json(
                    200, {"files": modes, "commitOid": hub.repos.get(match["repo"], {}).get("sha")}
                )
            match = re.fullmatch(rf"/api/models/{REPO}/commit/(?P<rev>[^/]+)", path)
            if match:
                return self._commit(unquote(match["repo"]), body)
            match = re.fullmatch(rf"/api/models/{REPO}/paths-info/(?P<rev>[^/]+)", path)
            if match:
                return self._json(200, [])
            self._not_found("EndpointNotFound")

        def _commit(self, repo: str, body: bytes) -> None:
            files, deleted = {}, []
            for line in body.decode().splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                if item["key"] == "file":
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] in ("deletedFile", "deletedFolder"):
                    deleted.append(item["value"]["path"])
            sha = hub.commit(repo, files, deleted)
            self._json(
                200, {"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha, "pullRequestUrl": None}
            )

        def _model_info(self, repo: str) -> None:
            if repo not in hub.repos:
                return self._not_found()
            entry = hub.repos[repo]
            siblings = [{"rfilename": name} for name in sorted(entry["files"])]
            self._json(
                200,
                {"id": repo, "modelId": repo, "sha": entry["sha"], "siblings": siblings, "private": False},
            )

        def _tree(self, repo: str) -> None:
            if repo not in hub.repos:
                return self._not_found()
            files = hub.repos[repo]["files"]
            self._json(
                200,
                [{"type": "file", "path": p, "size": len(b), "oid": "0"} for p, b in sorted(files.items())],
            )

        def _resolve(self, head: bool) -> None:
            match = re.fullmatch(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", urlparse(self.path).path)
            if not match or unquote(match["repo"]) not in hub.repos:
                return self._not_found(head=head)
            entry = hub.repos[unquote(match["repo"])]
            name = unquote(match["file"])
            if name not in entry["files"]:
                return self._not_found("EntryNotFound", head=head)
            data = entry["files"][name]
            etag = f'"{hashlib.sha1(data).hexdigest()}"'
            headers = {
                "X-Repo-Commit": entry["sha"],
                "ETag": etag,
                "Content-Type": "application/octet-stream",
            }
            self._send(200, data, headers, head)

    return Handler
