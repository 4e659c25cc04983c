"""A local stand-in for the Hugging Face Hub: the few endpoints the pin audit uses, served on 127.0.0.1.

The real `huggingface_hub.HfApi(endpoint=hub.url)` talks to it. Implemented (as the installed client
calls them, see huggingface_hub/hf_api.py):

* `GET  /api/models/{repo}[/revision/{rev}]`            model_info (`?blobs=True` adds size/lfs per sibling)
* `GET  /api/models/{repo}/tree/{rev}[/{path}]`          list_repo_tree (`?recursive=True`)
* `POST /api/models/{repo}/paths-info/{rev}`             get_paths_info (form: paths=..., silently drops missing)
* `HEAD/GET /{repo}/resolve/{rev}/{file}`                get_hf_file_metadata / download: X-Repo-Commit,
                                                         ETag, X-Linked-Etag (LFS sha256), X-Linked-Size

Errors carry the Hub's `X-Error-Code` header (RepoNotFound, RevisionNotFound, EntryNotFound), which the
client maps to its typed exceptions. `faults[endpoint] = Fault(status=500)` or `Fault(sleep=5.0)` makes an
endpoint fail or hang. Every file is stored in LFS with its real bytes, so sizes and hashes are real.
Files can be replaced *at a fixed commit* (`put(..., commit=sha)`), which the real Hub cannot do; it stands
for "the Hub now answers differently for the pinned revision", the case the audit must catch anyway.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def lfs_pointer(content: bytes) -> bytes:
    sha = hashlib.sha256(content).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(content)}\n".encode()


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class QuietServer(ThreadingHTTPServer):
    """A client that gave up (a timeout test) leaves a broken pipe behind: not worth a traceback."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@dataclass
class Fault:
    status: int = 0  # answer this HTTP status
    sleep: float = 0.0  # or hang this long before answering


class StandinHub:
    """repos[repo_id] = {"main": sha, "commits": {sha: {path: bytes}}}; start() -> base URL."""

    def __init__(self) -> None:
        self.repos: dict[str, dict] = {}
        self.faults: dict[str, Fault] = {}  # endpoint name ("revision", "model", "tree", "paths-info", "resolve")
        self.requests: list[tuple[str, str]] = []  # (method, path) served, in order
        self._server: ThreadingHTTPServer | None = None

    # -- state ------------------------------------------------------------------------------------
    def commit(self, repo: str, files: dict[str, bytes], parent: str | None = None, message: str = "") -> str:
        """New commit on main with `files` (added to the parent's tree); returns its sha."""
        r = self.repos.setdefault(repo, {"main": None, "commits": {}})
        base = dict(r["commits"][parent]) if parent else {}
        base.update(files)
        sha = hashlib.sha1(json.dumps([parent, message, sorted((p, hashlib.sha256(c).hexdigest())
                                                      for p, c in base.items())]).encode()).hexdigest()
        r["commits"][sha] = base
        r["main"] = sha
        return sha

    def put(self, repo: str, commit: str, path: str, content: bytes | None) -> None:
        """Replace (or with None: delete) a file *inside* an existing commit."""
        tree = self.repos[repo]["commits"][commit]
        if content is None:
            tree.pop(path)
        else:
            tree[path] = content

    def squash(self, repo: str) -> str:
        """Drop every commit but a new one holding main's files (like super_squash_history)."""
        r = self.repos[repo]
        files = r["commits"][r["main"]]
        r["commits"] = {}
        return self.commit(repo, dict(files), message="squashed history")

    # -- server -----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            state = hub

        self._server = QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "StandinHub":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _entry(path: str, content: bytes) -> dict:
    ptr = lfs_pointer(content)
    return {"type": "file", "path": path, "size": len(content), "oid": git_blob_oid(ptr),
            "lfs": {"oid": hashlib.sha256(content).hexdigest(), "size": len(content), "pointerSize": len(ptr)}}


def _dir_entry(path: str) -> dict:
    return {"type": "directory", "path": path, "size": 0, "oid": hashlib.sha1(path.encode()).hexdigest()}


class _Handler(BaseHTTPRequestHandler):
    state: StandinHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    # -- plumbing ---------------------------------------------------------------------------------
    def _send(self, status: int, body: object = None, headers: dict[str, str] | None = None,
              raw: bytes | None = None) -> None:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream" if raw is not None else "application/json")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        self._send(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _fault(self, endpoint: str) -> bool:
        f = self.state.faults.get(endpoint)
        if f is None:
            return False
        if f.sleep:
            time.sleep(f.sleep)
        if f.status:
            self._send(f.status, {"error": f"stand-in fault {f.status}"})
            return True
        return False

    def _resolve(self, repo: str, rev: str) -> tuple[str, dict[str, bytes]] | None:
        r = self.state.repos.get(repo)
        if r is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        sha = r["main"] if rev == "main" else rev
        if sha not in r["commits"]:
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return None
        return sha, r["commits"][sha]

    # -- routes -----------------------------------------------------------------------------------
    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        u = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(u.query)
        self.state.requests.append((self.command, u.path))
        parts = [urllib.parse.unquote(p) for p in u.path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo, rest = "/".join(parts[2:4]), parts[4:]
            if not rest:
                return self._model(repo, "main", q, "model")
            if rest[0] == "revision" and len(rest) == 2:
                return self._model(repo, rest[1], q, "revision")
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo, rest[1], "/".join(rest[2:]), q)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(repo="/".join(parts[:2]), rev=parts[3], path="/".join(parts[4:]))
        self._send(404, {"error": "no such endpoint"})

    def do_POST(self) -> None:
        u = urllib.parse.urlsplit(self.path)
        self.state.requests.append(("POST", u.path))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode()
        parts = [urllib.parse.unquote(p) for p in u.path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) == 6 and parts[4] == "paths-info":
            return self._paths_info("/".join(parts[2:4]), parts[5], urllib.parse.parse_qs(body))
        self._send(404, {"error": "no such endpoint"})

    def _model(self, repo: str, rev: str, q: dict, endpoint: str) -> None:
        if self._fault(endpoint):
            return
        got = self._resolve(repo, rev)
        if got is None:
            return
        sha, files = got
        blobs = q.get("blobs", [""])[0].lower() == "true"
        siblings = []
        for p, c in sorted(files.items()):
            s: dict = {"rfilename": p}
            if blobs:
                e = _entry(p, c)
                s.update(size=e["size"], blobId=e["oid"], lfs={"sha256": e["lfs"]["oid"], "size": e["size"],
                                                                 "pointerSize": e["lfs"]["pointerSize"]})
            siblings.append(s)
        self._send(200, {"id": repo, "modelId": repo, "sha": sha, "private": False, "siblings": siblings})

    def _tree(self, repo: str, rev: str, path: str, q: dict) -> None:
        if self._fault("tree"):
            return
        got = self._resolve(repo, rev)
        if got is None:
            return
        _, files = got
        recursive = q.get("recursive", ["false"])[0].lower() == "true"
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        under = {p: c for p, c in files.items() if p.startswith(prefix)}
        if prefix and not under:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        out, dirs = [], set()
        for p, c in sorted(under.items()):
            rel = p[len(prefix):].split("/")
            for i in range(1, len(rel)):
                dirs.add(prefix + "/".join(rel[:i]))
            if recursive or len(rel) == 1:
                out.append(_entry(p, c))
        depth = prefix.count("/")
        out += [_dir_entry(d) for d in sorted(dirs) if recursive or d.count("/") == depth]
        self._send(200, out)

    def _paths_info(self, repo: str, rev: str, form: dict) -> None:
        if self._fault("paths-info"):
            return
        got = self._resolve(repo, rev)
        if got is None:
            return
        _, files = got
        out = []
        for p in form.get("paths", []):
            if p in files:
                out.append(_entry(p, files[p]))
            elif any(f.startswith(p.rstrip("/") + "/") for f in files):
                out.append(_dir_entry(p))
            # missing paths are silently dropped, as on the real Hub
        self._send(200, out)

    def _file(self, repo: str, rev: str, path: str) -> None:
        if self._fault("resolve"):
            return
        got = self._resolve(repo, rev)
        if got is None:
            return
        sha, files = got
        if path not in files:
            return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}")
        c = files[path]
        e = _entry(path, c)
        self._send(200, None, {"X-Repo-Commit": sha, "ETag": f'"{e["oid"]}"', "X-Linked-Etag": f'"{e["lfs"]["oid"]}"',
                               "X-Linked-Size": str(len(c))}, raw=c)
