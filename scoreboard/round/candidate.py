"""Resolve `--candidate main|<git rev>|<path>` to the tree whose `engines/` an arm's workers import.

Every git arm (main, a PR's rev, the main arm of a PR round) runs from a clean export of its commit
(`git archive`), made into the round's private scratch root and re-verified against the commit's tree
hash before each use; no checkout is ever on a worker's import path. "main" is the checkout's HEAD and
must be on the lock's main branch. A path is a development tree: never main, never a frontier.

An engine with a repository of its own (`--engine-repo PATH`, a plugin) is resolved the same way in that
repository: its commits are the arms, its main branch is main, and an export holds its top-level package (found
through the entry point its own pyproject.toml declares at that commit) and that pyproject.toml, checked against
the commit's tree hash of the package. Its workers import the package from the export, ahead of any installed
copy, and the harness's own `engines/` (the bundled engines a plugin may build on) beside it.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

HARNESS_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class PluginCode:
    """Where a plugin arm's engine comes from: its own repository, at the arm's commit."""

    repo: Path  # the plugin's git repository (--engine-repo)
    url: str  # its remote's URL ("" when it has none)
    entry_point: str  # "module:attr", as its pyproject.toml at the commit declares the engine
    package: str  # the top-level package's directory in the repository at the commit, e.g. "src/sbplug"

    @property
    def package_parent(self) -> str:
        """The directory that goes on the worker's import path ("" = the export's root)."""
        return self.package.rpartition("/")[0]


@dataclass(frozen=True)
class CandidateSource:
    label: str  # "main", a git rev as given, or a path
    root: Path  # tree holding engines/ (a git arm: its export; a path: that tree); a plugin arm: its package's export
    commit: str
    dirty: bool
    is_main: bool
    kind: str = "git"  # "git": a clean export of `commit`; "path": a development tree
    engines_tree: str = ""  # git tree hash of the exported code at `commit` (engines/, or a plugin's package)
    plugin: PluginCode | None = None  # an engine repository of its own (None: this harness's repository)

    @property
    def code_dir(self) -> Path:
        """The exported code the tree hash covers: engines/, or a plugin's package."""
        return self.root / (self.plugin.package if self.plugin else "engines")

    def import_paths(self) -> tuple[Path, ...]:
        """What a worker puts first on its import path for this arm (a plugin's package parent), else ()."""
        if self.plugin is None:
            return ()
        parent = self.plugin.package_parent
        return (self.root / parent if parent else self.root,)

    def as_dict(self) -> dict:
        out = {"label": self.label, "root": str(self.root), "commit": self.commit, "dirty": self.dirty,
               "is_main": self.is_main, "kind": self.kind, "engines_tree": self.engines_tree}
        if self.plugin is not None:
            out["plugin"] = {"repo": str(self.plugin.repo), "url": self.plugin.url,
                             "entry_point": self.plugin.entry_point, "package": self.plugin.package}
        return out


def _git(args: list[str], cwd: Path, binary: bool = False):
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=not binary)
    if out.returncode != 0:
        err = out.stderr.decode(errors="replace") if binary else out.stderr
        raise InputError(f"git {' '.join(args)} failed in {cwd}: {err.strip()}")
    return out.stdout if binary else out.stdout.strip()


# What a candidate *runs*: its engines and the packaging that registers them (all an export holds).
CANDIDATE_CODE = ("engines", "pyproject.toml")
# The harness's own records in the checkout: every sealed round writes them (slots of the lock, receipts
# and the ledger), so they never make a tree dirty. Everything else, untracked files included (an
# untracked sitecustomize.py at the root runs in any Python started there), does. A pull request's commit
# that changes them is refused (refuse_records_change), and a round's records are kept durable apart from the
# work tree (scoreboard/history/durable.py), so no checkout or commit of the tree can lose them.
HARNESS_RECORDS = ("rounds", "reference.lock")


def require_engine(source: CandidateSource, engine: str) -> None:
    """A development tree (`--candidate PATH`) must hold the module the engine's entry point names (an empty or
    unrelated engines/ is a mistyped path: refused before any receipt exists). A git arm's engines/ is that
    commit's code: what it holds or lacks is the candidate's, recorded by the round."""
    from .. import registry

    if source.kind != "path":
        return
    try:
        module = registry.entry_point(engine).partition(":")[0]
    except InputError:
        return  # an engine injected as a factory (tests): no module to look for; the round reports it
    rel = Path(*module.split("."))
    if (source.root / rel).with_suffix(".py").is_file() or (source.root / rel / "__init__.py").is_file():
        return
    raise InputError(f"--candidate {source.label}: {source.root / 'engines'} holds no {engine} engine (its entry "
                     f"point {module} is neither {rel}.py nor {rel}/__init__.py there)",
                     "point --candidate at a checkout of this repository (its engines/ holds the engine), or at "
                     "main or a commit: --candidate main")


def dirty_paths(root: Path) -> list[str]:
    """Uncommitted changes under `root`: modified, staged, deleted and untracked non-ignored files,
    except the harness's own records (HARNESS_RECORDS)."""
    top = Path(_git(["rev-parse", "--show-toplevel"], root))
    spec = ["--", "."] + [f":(exclude){p}" for p in HARNESS_RECORDS]
    out = _git(["status", "--porcelain", "-z", "--untracked-files=all", *spec], top, binary=True)
    return [e[3:].decode(errors="replace") for e in out.split(b"\0") if len(e) > 3]


def _dirty(root: Path) -> bool:
    return bool(dirty_paths(root))


def branch_ref(branch: str, repo: Path) -> str:
    """refs/heads/<branch>, which must exist in `repo`."""
    ref = f"refs/heads/{branch}"
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet", ref], cwd=repo, capture_output=True).returncode:
        raise InputError(f"the lock's main_branch {branch!r}: {repo} has no {ref}",
                         f"fetch the branch (git fetch origin {branch}:{branch}) or fix main_branch in the lock")
    return ref


def on_branch(commit: str, branch: str, repo: Path) -> bool:
    """Whether `commit` is reachable from refs/heads/<branch> (is on the branch)."""
    ref = branch_ref(branch, repo)
    return subprocess.run(["git", "merge-base", "--is-ancestor", commit, ref], cwd=repo,
                          capture_output=True).returncode == 0


def resolve(spec: str, scratch: Path, repo: Path = HARNESS_ROOT, main_branch: str = "main") -> CandidateSource:
    """main = the checkout's HEAD, which must be on refs/heads/<main_branch>; a path = that tree (development
    only); else a git rev of `repo`. Git arms are exported into `scratch` (the round's private root)."""
    if spec == "main":
        try:
            commit = _git(["rev-parse", "--verify", "HEAD^{commit}"], repo)
        except InputError as exc:
            raise InputError(f"--candidate main: {repo} is not a git checkout with a commit ({exc.message})",
                             "run main rounds from a clone of the repository") from None
        if not on_branch(commit, main_branch, repo):
            raise InputError(f"--candidate main: HEAD {commit[:12]} of {repo} is not on the main branch "
                             f"refs/heads/{main_branch}; only commits on it are main",
                             f"check out {main_branch} (git switch {main_branch}), or grade this commit as a pull "
                             f"request: --candidate {commit[:12]}")
        return export(commit, "main", True, scratch, repo, dirty=_dirty(repo))
    path = Path(spec)
    if path.exists():
        if not (path / "engines").is_dir():
            raise InputError(f"--candidate {spec}: no engines/ directory there",
                             "point --candidate at a checkout of this repository")
        try:
            commit, dirty = _git(["rev-parse", "HEAD"], path), _dirty(path)
        except InputError:
            commit, dirty = "", True
        return CandidateSource(str(path), path.resolve(), commit, dirty, False, "path")
    try:
        commit = _git(["rev-parse", "--verify", f"{spec}^{{commit}}"], repo)
    except InputError:
        raise InputError(f"--candidate {spec!r} is neither 'main', an existing path, nor a git revision",
                         "pass --candidate main, a commit/branch of this repository, or a path to a checkout") from None
    refuse_records_change(spec, commit, repo, main_branch)
    return export(commit, spec, False, scratch, repo)


def refuse_records_change(spec: str, commit: str, repo: Path, main_branch: str) -> None:
    """A pull request's commit that changes the harness's records (HARNESS_RECORDS) relative to main is refused:
    graded, merged, or checked out, it would carry ledger lines and slots that no round of it sealed."""
    base = _git(["merge-base", branch_ref(main_branch, repo), commit], repo)
    changed = _git(["diff", "--name-only", "--no-renames", base, commit, "--", *HARNESS_RECORDS], repo).splitlines()
    if changed:
        shown = ", ".join(changed[:5]) + (f" (and {len(changed) - 5} more)" if len(changed) > 5 else "")
        raise InputError(f"--candidate {spec}: commit {commit[:12]} changes the harness's records relative to "
                         f"{main_branch} ({base[:12]}): {shown}; only a round writes rounds/ and the lock's slots, and a "
                         "pull request carries engine code",
                         f"take those paths out of the commit (`git checkout {main_branch} -- {' '.join(changed[:5])}` "
                         "and commit), then grade it again; a policy change to reference.lock is its own reviewed "
                         "pull request, checked by `scoreboard verify --base`")


def contract_version(commit: str, repo: Path = HARNESS_ROOT) -> int:
    """The engine contract version a commit was written against: its scoreboard/engine.py's CONTRACT_VERSION
    (absent: 1). Read from the harness's own git objects, which no candidate process can write. A commit the
    repository does not have is an InputError (the caller names the fix), never "an old contract": that would
    quietly swap the same-round frontier arm for the pinned slot."""
    _git(["cat-file", "-e", f"{commit}^{{commit}}"], repo)
    try:
        text = _git(["show", f"{commit}:scoreboard/engine.py"], repo)
    except InputError:
        return 1
    m = re.search(r"^CONTRACT_VERSION = (\d+)", text, re.MULTILINE)
    return int(m.group(1)) if m else 1


def remeasure_problem(commit: str, repo: Path = HARNESS_ROOT) -> str | None:
    """Why this harness cannot run `commit`'s engines as a round's frontier arm (None: it can): the engine contract
    it was written against is not this harness's (contract_version; a commit the repository lacks: InputError)."""
    from ..engine import CONTRACT_VERSION

    version = contract_version(commit, repo)
    return None if version == CONTRACT_VERSION else f"speaks engine contract {version}, this harness {CONTRACT_VERSION}"


def resolve_main_arm(scratch: Path, repo: Path = HARNESS_ROOT, main_branch: str = "main") -> CandidateSource:
    """A PR round's main arm: the tip of refs/heads/<main_branch>, exported like any git arm (never the
    checkout, which the candidate's own processes could have written)."""
    commit = _git(["rev-parse", "--verify", f"{branch_ref(main_branch, repo)}^{{commit}}"], repo)
    return export(commit, "main", True, scratch, repo)


def _unpack(data: bytes, dest: Path, what: str) -> None:
    """A `git archive` tar into `dest`: nothing outside it, no device files, no setuid bits (scoreboard.archive);
    a commit holding such a member (a symlink to anywhere) is the candidate's input error."""
    from ..archive import UnsafeMember, extract_tar

    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        try:
            extract_tar(tar, dest)
        except UnsafeMember as exc:
            raise InputError(f"{what} holds a file the harness will not unpack: {exc}",
                             "remove it from the commit (a symlink must stay inside the tree)") from None


def export(commit: str, label: str, is_main: bool, scratch: Path, repo: Path, dirty: bool = False) -> CandidateSource:
    """`git archive` of CANDIDATE_CODE at `commit`, unpacked into a fresh directory of `scratch` and checked
    against the commit's tree hash of engines/."""
    names = set(_git(["ls-tree", "--name-only", commit], repo).splitlines())
    if "engines" not in names:
        raise InputError(f"--candidate {label}: commit {commit[:12]} has no engines/ directory",
                         "grade a commit of this repository")
    tree = _git(["rev-parse", f"{commit}:engines"], repo)
    data = _git(["archive", "--format=tar", commit, *[p for p in CANDIDATE_CODE if p in names]], repo, binary=True)
    dest = Path(tempfile.mkdtemp(prefix=f"arm-{commit[:12]}-", dir=scratch))  # private (0700)
    _unpack(data, dest, f"--candidate {label}: commit {commit[:12]}")
    src = CandidateSource(label, dest, commit, dirty, is_main, "git", tree)
    verify_export(src)
    return src


def verify_export(source: CandidateSource) -> None:
    """Refuse an export whose code (engines/, or a plugin's package) no longer hashes to its commit's tree
    (checked before each use)."""
    if source.kind != "git":
        return
    got = tree_hash(source.code_dir)
    if got != source.engines_tree:
        what = source.plugin.package if source.plugin else "engines"
        raise InputError(f"the export of {source.label} ({source.commit[:12]}) at {source.root} changed: {what}/ "
                         f"hashes to tree {got[:12]}, the commit has {source.engines_tree[:12]}",
                         "something wrote into the round's private scratch; re-run the round")


def tree_hash(path: Path) -> str:
    """git's tree object id of the directory at `path` (as `git write-tree` would compute for it)."""
    entries = []
    for entry in os.scandir(path):
        p = Path(entry.path)
        if entry.is_symlink():
            mode, oid = b"120000", _object(b"blob", os.readlink(p).encode())
        elif entry.is_dir():
            mode, oid = b"40000", tree_hash(p)
        else:
            mode = b"100755" if p.stat().st_mode & 0o100 else b"100644"
            oid = _object(b"blob", p.read_bytes())
        key = entry.name.encode() + (b"/" if mode == b"40000" else b"")
        entries.append((key, mode + b" " + entry.name.encode() + b"\0" + bytes.fromhex(oid)))
    return _object(b"tree", b"".join(e for _, e in sorted(entries)))


def _object(kind: bytes, body: bytes) -> str:
    return hashlib.sha1(kind + b" " + str(len(body)).encode() + b"\0" + body).hexdigest()


def import_root(source: CandidateSource, cache_dir: Path) -> Path:
    """The directory whose `engines` a worker imports: a git arm's export (it holds only CANDIDATE_CODE),
    re-verified here before each launch; for a development path, a shim holding only `engines` -> the tree's
    engines/, so that not even an unsandboxed worker has the rest of that tree on its path. A plugin arm's export
    (re-verified too) goes on the path through `source.import_paths()`; its `engines` is the harness's own."""
    if source.kind == "git":
        verify_export(source)
        return _shim(HARNESS_ROOT, cache_dir) if source.plugin else source.root
    return _shim(source.root, cache_dir)


def _shim(tree: Path, cache_dir: Path) -> Path:
    """A directory holding only `engines` -> tree/engines."""
    key = hashlib.sha256(str(tree).encode()).hexdigest()[:16]
    shim = Path(cache_dir) / "import-shims" / key
    shim.mkdir(parents=True, exist_ok=True)
    link = shim / "engines"
    target = tree / "engines"
    if link.is_symlink() and os.readlink(link) != str(target):
        link.unlink()
    if not link.exists():
        link.symlink_to(target, target_is_directory=True)
    return shim


# ----------------------------------------------------------------------------------------------
# an engine repository of its own (--engine-repo): a plugin compared across its own commits

ENTRY_GROUP = "scoreboard.engines"


def plugin_repo(path: Path) -> Path:
    """`path` as the top of a git repository with a commit (InputError naming the option otherwise)."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"--engine-repo {path}: no such directory", "pass the path of the plugin's git checkout")
    try:
        top = Path(_git(["rev-parse", "--show-toplevel"], path))
        _git(["rev-parse", "--verify", "HEAD^{commit}"], top)
    except InputError:
        raise InputError(f"--engine-repo {path}: not a git repository with a commit",
                         "pass the path of the plugin's git checkout (git init && git commit first)") from None
    return top.resolve()


def remote_url(repo: Path) -> str:
    """The repository's `origin` URL, else its first remote's, else ""."""
    names = _git(["remote"], repo).split()
    if not names:
        return ""
    return _git(["remote", "get-url", "origin" if "origin" in names else names[0]], repo)


def resolve_plugin(spec: str, scratch: Path, repo: Path, main_branch: str, engine: str) -> CandidateSource:
    """--candidate main|<rev> of a plugin repository: main = its HEAD, which must be on refs/heads/<main_branch>;
    a rev = a commit of that repository. Exported like any git arm (a path is no plugin arm: pass a commit)."""
    if spec == "main":
        commit = _git(["rev-parse", "--verify", "HEAD^{commit}"], repo)
        if not on_branch(commit, main_branch, repo):
            raise InputError(f"--candidate main: HEAD {commit[:12]} of {repo} is not on its main branch "
                             f"refs/heads/{main_branch}; only commits on it are main",
                             f"check out {main_branch} in {repo}, or grade this commit as a pull request: "
                             f"--candidate {commit[:12]}")
        return export_plugin(commit, "main", True, scratch, repo, engine, dirty=_dirty(repo))
    try:
        commit = _git(["rev-parse", "--verify", f"{spec}^{{commit}}"], repo)
    except InputError:
        raise InputError(f"--candidate {spec!r} is neither 'main' nor a git revision of --engine-repo {repo}",
                         f"pass --candidate main or a commit/branch of {repo} (`git -C {repo} log --oneline`)") from None
    return export_plugin(commit, spec, False, scratch, repo, engine)


def resolve_plugin_main(scratch: Path, repo: Path, main_branch: str, engine: str) -> CandidateSource:
    """A PR round's main arm of a plugin: the tip of its refs/heads/<main_branch>, exported."""
    commit = _git(["rev-parse", "--verify", f"{branch_ref(main_branch, repo)}^{{commit}}"], repo)
    return export_plugin(commit, "main", True, scratch, repo, engine)


def plugin_entry_point(commit: str, repo: Path, engine: str) -> tuple[str, str]:
    """(the "module:attr" engine `engine` is registered as, the top-level package's directory) in the plugin's own
    pyproject.toml at `commit`; InputError naming the file and the fix when it declares no such engine."""
    import tomlkit

    where = f"{repo}/pyproject.toml at {commit[:12]}"
    try:
        text = _git(["show", f"{commit}:pyproject.toml"], repo)
    except InputError:
        raise InputError(f"--engine-repo {repo}: commit {commit[:12]} has no pyproject.toml",
                         f"a plugin declares its engine in pyproject.toml: [project.entry-points.\"{ENTRY_GROUP}\"] "
                         f"{engine} = \"package.module:EngineClass\"") from None
    try:
        data = tomlkit.parse(text).unwrap()
    except Exception as exc:  # tomlkit raises its own ParseError subclasses
        raise InputError(f"{where}: not valid TOML ({exc})", "fix the file and commit it") from None
    eps = (data.get("project") or {}).get("entry-points") or {}
    spec = (eps.get(ENTRY_GROUP) or {}).get(engine)
    if not isinstance(spec, str) or ":" not in spec:
        declared = sorted((eps.get(ENTRY_GROUP) or {}))
        raise InputError(f"{where}: [project.entry-points.\"{ENTRY_GROUP}\"] declares no engine {engine!r} "
                         f"(it declares {declared or 'none'}); the target's candidate_engine names it",
                         f"add `{engine} = \"package.module:EngineClass\"` there, or fix candidate_engine in the lock")
    top = spec.partition(":")[0].split(".")[0]
    if top in ("engines", "scoreboard"):
        raise InputError(f"{where}: engine {engine!r} lives in the package {top!r}, the harness's own name",
                         f"an engine in this harness's {top}/ needs no --engine-repo; a plugin names its own package")
    return spec.strip(), _package_dir(commit, repo, top, data, where)


def _package_dir(commit: str, repo: Path, top: str, pyproject: dict, where: str) -> str:
    """Where the top-level package `top` sits at `commit`: under the package-dir or packages.find `where` the
    pyproject names, else at the root, else under src/."""
    setup = (pyproject.get("tool") or {}).get("setuptools") or {}
    package_dir = setup.get("package-dir") or {}
    packages = setup.get("packages")
    find = (packages.get("find") or {}) if isinstance(packages, dict) else {}
    bases = [str(package_dir.get("", "")), *map(str, find.get("where", [])), "", "src"]
    for base in dict.fromkeys("" if b.strip("/") in ("", ".") else b.strip("/").removeprefix("./") for b in bases):
        path = f"{base}/{top}" if base else top
        kind = subprocess.run(["git", "cat-file", "-t", f"{commit}:{path}"], cwd=repo, capture_output=True, text=True)
        if kind.returncode == 0 and kind.stdout.strip() == "tree":
            return path
    raise InputError(f"{where}: the entry point's package {top!r} is not a directory of the commit (looked in "
                     f"the package-dir/packages.find of its pyproject, the root and src/)",
                     "a plugin's engine lives in a package directory of its repository; commit it there")


def export_plugin(commit: str, label: str, is_main: bool, scratch: Path, repo: Path, engine: str,
                  dirty: bool = False) -> CandidateSource:
    """`git archive` of the plugin's package and pyproject.toml at `commit`, into a fresh directory of `scratch`,
    checked against the commit's tree hash of the package."""
    spec, package = plugin_entry_point(commit, repo, engine)
    tree = _git(["rev-parse", f"{commit}:{package}"], repo)
    data = _git(["archive", "--format=tar", commit, package, "pyproject.toml"], repo, binary=True)
    dest = Path(tempfile.mkdtemp(prefix=f"plugin-{commit[:12]}-", dir=scratch))  # private (0700)
    _unpack(data, dest, f"--candidate {label}: the plugin's commit {commit[:12]}")
    src = CandidateSource(label, dest, commit, dirty, is_main, "git", tree,
                          PluginCode(repo, remote_url(repo), spec, package))
    verify_export(src)
    return src


@dataclass(frozen=True)
class Origin:
    """The repository a round's candidate-side arms are commits of: this harness's (engines/), or an engine
    repository of its own (`engine` set: plugin arms of that engine, --engine-repo)."""

    repo: Path
    engine: str = ""

    @property
    def plugin(self) -> bool:
        return bool(self.engine)

    def resolve(self, spec: str, scratch: Path, main_branch: str) -> CandidateSource:
        if not self.plugin:
            return resolve(spec, scratch, self.repo, main_branch)
        if spec != "main" and Path(spec).exists() and not _is_rev(spec, self.repo):
            raise InputError(f"--candidate {spec}: a path is a development tree of this harness's repository, and "
                             f"--engine-repo compares commits of {self.repo}",
                             f"commit the change in {self.repo} and pass --candidate <that commit>")
        return resolve_plugin(spec, scratch, self.repo, main_branch, self.engine)

    def main_arm(self, scratch: Path, main_branch: str) -> CandidateSource:
        if not self.plugin:
            return resolve_main_arm(scratch, self.repo, main_branch)
        return resolve_plugin_main(scratch, self.repo, main_branch, self.engine)

    def export(self, commit: str, label: str, is_main: bool, scratch: Path) -> CandidateSource:
        if not self.plugin:
            return export(commit, label, is_main, scratch, self.repo)
        return export_plugin(commit, label, is_main, scratch, self.repo, self.engine)

    def contract_version(self, commit: str, current: int) -> int:
        """The engine contract `commit` was written against. A plugin's commit imports only this harness's
        contract (it ships none of its own), so it speaks `current`; the commit must exist either way."""
        if not self.plugin:
            return contract_version(commit, self.repo)
        _git(["cat-file", "-e", f"{commit}^{{commit}}"], self.repo)
        return current


def _is_rev(spec: str, repo: Path) -> bool:
    return subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"], cwd=repo,
                          capture_output=True).returncode == 0
