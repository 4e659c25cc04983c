"""Real parts for the pin-audit tests: local bare git remotes, a stand-in PyPI JSON API, and lock files naming them."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from standin_hub import QuietServer
from pathlib import Path

import git

# ------------------------------------------------------------------------------------------------
# git


class GitRemote:
    """A bare repository served by file:// plus a work repo that makes commits and pushes refs to it."""

    def __init__(self, root: Path) -> None:
        self.work = git.Repo.init(root / "work")
        with self.work.config_writer() as cw:
            cw.set_value("user", "name", "audit test")
            cw.set_value("user", "email", "audit@test.invalid")
        self.bare_path = root / "remote.git"
        git.Repo.init(self.bare_path, bare=True)
        self.url = self.bare_path.as_uri()
        self._n = 0

    def commit(self, message: str, parent: str | None = None) -> str:
        """A new commit (one file changed) on top of `parent` (None: a new root); HEAD is not moved."""
        self._n += 1
        (Path(self.work.working_dir) / "f.txt").write_text(f"{message} {self._n}\n")
        self.work.git.add("f.txt")
        tree = self.work.git.write_tree()
        args = [tree, "-m", message] + (["-p", parent] if parent else [])
        return self.work.git.commit_tree(*args)

    def push(self, sha: str, ref: str) -> None:
        self.work.git.push(self.url, f"+{sha}:{ref}")

    def delete(self, ref: str) -> None:
        self.work.git.push(self.url, f":{ref}")

    def tag(self, name: str, sha: str) -> None:
        self.work.git.tag("-a", name, sha, "-m", name)
        self.work.git.push(self.url, f"refs/tags/{name}")


# ------------------------------------------------------------------------------------------------
# PyPI JSON API stand-in


@dataclass
class StandinPypi:
    """releases[(package, version)] = list of url entries; `fault = (status, sleep)` breaks every request."""

    releases: dict[tuple[str, str], list[dict]] = field(default_factory=dict)
    fault: tuple[int, float] | None = None
    version_json: bool = True  # False: 404 on /pypi/<p>/<v>/json, as some proxies do; /pypi/<p>/json still answers
    _server: ThreadingHTTPServer | None = None

    def add(self, package: str, version: str, content: bytes, packagetype: str = "sdist", **extra: object) -> str:
        sha = hashlib.sha256(content).hexdigest()
        name = f"{package.replace('-', '_')}-{version}" + (".tar.gz" if packagetype == "sdist" else "-py3-none-any.whl")
        self.releases.setdefault((package, version), []).append(
            {"filename": name, "packagetype": packagetype, "digests": {"sha256": sha}, "size": len(content),
             "yanked": False, "yanked_reason": None, **extra})
        return sha

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "StandinPypi":
        state = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:
                parts = [urllib.parse.unquote(p) for p in urllib.parse.urlsplit(self.path).path.split("/")[1:]]
                if state.fault:
                    status, sleep = state.fault
                    time.sleep(sleep)
                    if status:
                        return self._send(status, {"message": "stand-in fault"})
                if len(parts) == 4 and parts[0] == "pypi" and parts[3] == "json" and state.version_json:
                    urls = state.releases.get((parts[1], parts[2]))
                    if urls is not None:
                        return self._send(200, {"info": {"name": parts[1], "version": parts[2]}, "urls": urls})
                if len(parts) == 3 and parts[0] == "pypi" and parts[2] == "json":
                    rel = {v: u for (p, v), u in state.releases.items() if p == parts[1]}
                    if rel:
                        return self._send(200, {"info": {"name": parts[1], "version": max(rel)}, "releases": rel})
                self._send(404, {"message": "Not Found"})

            def _send(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()


def closed_port() -> int:
    """A local TCP port nothing listens on (connection refused)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------------------------------------------
# lock files

_TARGET = '''
[targets.{tid}]
model = "k3-mini"
weights = "{wid}"
quant = "Q"
node = "cpu"
reference = "{rid}"
reference_engine = "llamacpp"
candidate_engine = "sparkinfer"
device = "cpu"
geometry = {{ n_ctx = 2048, n_batch = 512, n_ubatch = 512 }}
metrics = [{{ phase = "decode", depth = 1024, n_tokens = 32, role = "scored" }}]
gate = {{ depths = [1024], rows_per_depth = 8, top1_min = 0.95, kl_max = 0.05, kl_prefer = 0.02, kl_p99_max = 0.5 }}
tiers = {{ buckets = {{ XS = 0.02, S = 0.035 }}, max_ci_width = 0.04, guard_tolerance = 0.01 }}
speed = {{ warmup_reps = 1, reps = 3, blocks = 4, timeout_s = 600 }}
'''


def git_ref_toml(rid: str, url: str, ref: str, commit: str, base: str) -> str:
    return (f'[references.{rid}]\n# a pinned PR head\nkind = "git"\nrepo = "{url}"\nref = "{ref}"\n'
            f'commit = "{commit}"\nbase_commit = "{base}"\n')


def sdist_ref_toml(rid: str, package: str, version: str, sha256: str) -> str:
    return (f'[references.{rid}]\nkind = "pypi-sdist"\npackage = "{package}"\nversion = "{version}"\n'
            f'sha256 = "{sha256}"\nsubdir = "vendor/llama.cpp"\n')


def weights_toml(wid: str, repo: str, revision: str, files: list[tuple[str, int, str]], quant: str = "Q") -> str:
    rows = "".join(f'  {{ path = "{p}", size = {s}, sha256 = "{h}" }},\n' for p, s, h in files)
    return (f'[weights.{wid}]\n# pinned shards: keep this comment\nrepo = "{repo}"\nrevision = "{revision}"\n'
            f'quant = "{quant}"\nfiles = [\n{rows}]\n')


def generated_weights_toml(wid: str) -> str:
    return (f'[weights.{wid}]\nrepo = "generated"\nspec = "k3-mini"\nseed = 7\nquant = "F16"\n'
            f'files = [{{ path = "m.gguf", size = 10, sha256 = "{"a" * 64}" }}]\n')


def write_lock(path: Path, sections: list[str], targets: dict[str, tuple[str, str]]) -> Path:
    """`targets[tid] = (reference id, weights id)`; a slot line shows that pinning never touches slots."""
    text = "# test lock\nschema = 1\n\n" + "\n".join(sections) + '\n[nodes.cpu]\ngpu_count = 0\n'
    text += "".join(_TARGET.format(tid=t, rid=r, wid=w) for t, (r, w) in targets.items())
    if targets:
        text += '\n[slots]\n# slot comment\nK3_MINI_CPU_Q_SPARKINFER_DECODE_1K = { value = 0.0, kind = "frontier" }\n'
    path.write_text(text)
    return path


def shard_bytes(i: int, n: int = 1000) -> bytes:
    """Deterministic shard content: real bytes, so sizes and sha256 are real."""
    return hashlib.sha256(f"shard {i}".encode()).digest() * (n // 32 + 1)


def pins_of(files: dict[str, bytes]) -> list[tuple[str, int, str]]:
    return [(p, len(c), hashlib.sha256(c).hexdigest()) for p, c in sorted(files.items())]
