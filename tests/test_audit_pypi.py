"""PyPI sdist pins against a stand-in PyPI JSON API on 127.0.0.1: hash holds, hash changed, release gone,
no sdist (drift); HTTP 500, timeout, connection refused (errors)."""

from __future__ import annotations

import pytest

from audit_fixtures import StandinPypi, closed_port
from scoreboard.lockfile import SdistReference
from scoreboard.pins.pypi import check_sdist

PKG, VER = "llama-cpp-python", "0.3.36"


@pytest.fixture
def pypi(monkeypatch):
    with StandinPypi() as p:
        p.sha = p.add(PKG, VER, b"the sdist bytes")
        p.add(PKG, VER, b"a wheel", packagetype="bdist_wheel")
        monkeypatch.setenv("SCOREBOARD_PYPI_URL", p.url)
        yield p


def ref(sha: str) -> SdistReference:
    return SdistReference(kind="pypi-sdist", package=PKG, version=VER, sha256=sha, subdir="vendor/llama.cpp")


def check(sha: str, timeout: float = 5.0):
    (f,) = check_sdist("r", ref(sha), timeout=timeout, targets=("t",))
    return f


def test_pinned_sdist_holds(pypi):
    f = check(pypi.sha)
    assert f.kind == "ok" and f.message.startswith("llama_cpp_python-0.3.36.tar.gz sha256 ")


def test_changed_sdist_hash_is_drift(pypi):
    pinned = "0" * 64
    f = check(pinned)
    assert f.kind == "drift" and (f.was, f.now) == (pinned, pypi.sha)
    assert "update references.r.sha256" in f.action


def test_deleted_release_is_drift(pypi):
    pypi.add(PKG, "0.3.37", b"next")
    del pypi.releases[(PKG, VER)]
    f = check(pypi.sha)
    assert f.kind == "drift" and "HTTP 404" in f.message
    assert "the project lists no release 0.3.36 (latest: 0.3.37)" in f.message


def test_deleted_project_is_drift(pypi):
    pypi.releases.clear()
    f = check(pypi.sha)
    assert f.kind == "drift" and f.now == "(missing)"


def test_a_404_of_the_release_document_alone_is_not_drift(pypi):
    """Seen through this project's PyPI proxy: /pypi/<p>/<v>/json 404s while /pypi/<p>/json answers."""
    pypi.version_json = False
    assert check(pypi.sha).kind == "ok"
    assert check("0" * 64).kind == "drift"


def test_release_without_sdist_is_drift(pypi):
    pypi.releases[(PKG, VER)] = [u for u in pypi.releases[(PKG, VER)] if u["packagetype"] != "sdist"]
    f = check(pypi.sha)
    assert f.kind == "drift" and f.now == "(no sdist)"


def test_yanked_release_is_noted_not_drift(pypi):
    pypi.releases[(PKG, VER)][0].update(yanked=True, yanked_reason="broken build")
    f = check(pypi.sha)
    assert f.kind == "ok" and "yanked (broken build)" in f.message


@pytest.mark.parametrize("fault,text", [((500, 0.0), "HTTP 500"), ((429, 0.0), "HTTP 429"),
                                        ((0, 3.0), "timed out after 0.5 s")])
def test_pypi_failure_is_an_error_not_drift(pypi, fault, text):
    pypi.fault = fault
    f = check(pypi.sha, timeout=0.5)
    assert f.kind == "error" and text in f.message and "this is not drift" in f.action


def test_connection_refused_is_an_error(monkeypatch):
    monkeypatch.setenv("SCOREBOARD_PYPI_URL", f"http://127.0.0.1:{closed_port()}")
    f = check("0" * 64)
    assert f.kind == "error" and "refused" in f.message.lower()
