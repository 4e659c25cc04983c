"""Throwaway git repositories of candidate trees, and a hostile engine that reports what it could reach.

A repository here holds what a candidate commit holds (engines/ and pyproject.toml, copied from this
checkout's committed tree) on a `main` branch; a test commits hostile changes on top and grades them with
run_round(repo=...). The hostile engine runs its attacks inside the worker (inside the sandbox) and ends
the launch with an EngineError whose message carries a JSON report of what each attack achieved: the
round then aborts (it awards nothing) and the test reads the report from the receipt's abort reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path


from receipt_factory import shrunk_lock
from scoreboard.round.candidate import HARNESS_ROOT

TARGET = "k3-mini-cpu"


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def make_repo(root: Path) -> Path:
    """A git repo whose `main` holds this checkout's committed engines/ and pyproject.toml."""
    root.mkdir(parents=True)
    git(root, "init", "-q", "-b", "main")
    data = subprocess.run(["git", "archive", "--format=tar", "HEAD", "engines", "pyproject.toml"], cwd=HARNESS_ROOT,
                          capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=data, check=True)
    (root / ".gitignore").write_text("__pycache__/\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "main")
    return root


def commit_files(repo: Path, files: dict[str, str], message: str = "hostile") -> str:
    for rel, text in files.items():
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def small_lock(tmp_path: Path) -> Path:
    return shrunk_lock(tmp_path / "reference.lock", TARGET)


HOSTILE_ENGINE = '''
import json
import numpy as np
from scoreboard.engine import Engine, EngineIdentity, LogitsResult, Prepared
from scoreboard.errors import EngineError
from . import attacks


class SparkInferEngine(Engine):
    name = "sparkinfer"
    clock = "harness"
    max_ranks = 8

    def describe(self, target):
        return EngineIdentity(engine="sparkinfer", version="hostile", source={"hostile": True})

    def prepare(self, target, cache_dir, progress=None):
        raise EngineError("FINDINGS " + json.dumps(attacks.run(target, cache_dir)) + " ENDFINDINGS")

    def logits(self, prepared, request):
        return LogitsResult(np.zeros((len(request.positions), 8), np.float32), request.geometry)

    def begin(self, prepared, workload):
        return workload

    def step(self, prepared, workload):
        return [0] * workload.n_tokens
'''

ATTACKS = '''
import json, os, socket, sys

CTX = json.loads(%r)


def _write(path):
    try:
        with open(path, "a") as fh:
            fh.write("pwned\\n")
        return "WROTE"
    except OSError as exc:
        return f"blocked: {exc.strerror}"


def _read(path):
    try:
        with open(path, "rb") as fh:
            return "READ " + fh.read(64).decode(errors="replace")
    except OSError as exc:
        return f"blocked: {exc.strerror}"


def _sysctl(path):
    """Write access to a host kernel setting, shown by writing its own value back: a sandbox that lets it
    through still changes nothing on the host the tests run on."""
    try:
        value = open(path).read()
        with open(path, "w") as fh:
            fh.write(value)
        return "WROTE"
    except OSError as exc:
        return f"blocked: {exc.strerror}"


def _limits():
    import resource
    out = {n: list(resource.getrlimit(getattr(resource, "RLIMIT_" + n))) for n in ("NPROC", "NOFILE", "FSIZE", "CORE",
                                                                                    "AS")}
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        out["raise"] = "RAISED"
    except (OSError, ValueError) as exc:
        out["raise"] = f"blocked: {exc}"
    return out


def run(target, cache_dir):
    out = {"uid": os.getuid(), "pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd(), "sys_path": sys.path,
           "engine_file": __file__, "sitecustomize": "sitecustomize" in sys.modules,
           "sitecustomize_ran": os.environ.get("SITECUSTOMIZE_RAN", "")}
    # (a) write into the harness checkout, the lock, rounds/, the real cache; and (own) into the weights the
    # harness verified, the harness package as the worker sees it, and the arm's own engines/
    out["write"] = {p: _write(p) for p in CTX["write_targets"]}
    out["write_weights"] = {str(p): _write(str(p)) for p in target.shard_paths}
    out["write_harness_pkg"] = _write("/sb/harness/scoreboard/round/clock.py")
    out["write_own_engines"] = _write(__file__)
    out["cache_dir"] = str(cache_dir)
    out["write_given_cache"] = _write(os.path.join(str(cache_dir), "planted"))
    # (b) the signing key's variable in any process's environment this process can see
    hits, pids = [], []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pids.append(int(name))
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        if b"SCOREBOARD_SIGNING_KEY" in data or CTX["key_file"].encode() in data:
            hits.append(int(name))
    out["environ_hits"], out["pids"] = hits, sorted(pids)
    out["own_env"] = sorted(os.environ)
    # (h) the host's kernel settings (vm/stat_interval, kernel/core_pattern), its privileges and its limits
    out["sysctl"] = {p: _sysctl(p) for p in ("/proc/sys/vm/stat_interval", "/proc/sys/kernel/core_pattern")}
    status = dict(l.rstrip("\\n").split(":\\t", 1) for l in open("/proc/self/status") if ":\\t" in l)
    out["status"] = {k: status[k] for k in ("Uid", "Gid", "Groups", "CapEff", "CapPrm", "NoNewPrivs")}
    out["uid_map"] = open("/proc/self/uid_map").read().split()
    out["limits"] = _limits()
    # (c) the signing key file itself
    out["key"] = _read(CTX["key_file"])
    # (own) the harness checkout, and the round's other scratch (other arms' exports, earlier launches)
    out["harness_root_visible"] = os.path.exists(CTX["harness_root"])
    out["lock_read"] = _read(CTX["lock"])
    out["round_root_listing"] = sorted(os.listdir(os.path.dirname(os.getcwd())))
    # (f) a double-fork daemon in its own session, meant to outlive the launch
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", CTX["marker"]])
        os._exit(0)
    os.waitpid(pid, 0)
    # (g) the network: a TCP listener the test opened on the host's 127.0.0.1
    try:
        socket.create_connection(("127.0.0.1", CTX["port"]), timeout=3).close()
        out["net"] = "CONNECTED"
    except OSError as exc:
        out["net"] = f"blocked: {exc}"
    return out
'''


def hostile_files(ctx: dict) -> dict[str, str]:
    return {"engines/sparkinfer/engine.py": textwrap.dedent(HOSTILE_ENGINE),
            "engines/sparkinfer/attacks.py": ATTACKS % json.dumps(ctx)}


def findings(receipt: dict) -> dict:
    reason = (receipt.get("aborted") or {}).get("reason", "")
    m = re.search(r"FINDINGS (\{.*\}) ENDFINDINGS", reason, re.DOTALL)
    assert m, f"no findings in the abort reason: {reason[:2000]}"
    return json.loads(m.group(1))


def processes_naming(text: str) -> list[int]:
    """Host pids whose command line contains `text` (this process excluded)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if text.encode() in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out
