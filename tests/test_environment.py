"""Environment fingerprint: best effort, never raises; node-class refusals name the differing field."""

from __future__ import annotations

from scoreboard import environment
from scoreboard.lockfile import NodeClass


def test_fingerprint_has_the_fields_receipts_record():
    fp = environment.fingerprint()
    assert {"cpu", "ram_gib", "gpu", "packages", "harness", "kernel", "python"} <= set(fp)
    assert fp["cpu"]["cores"] >= 1 and "numpy" in fp["packages"] and "scoreboard" in fp["packages"]
    assert len(fp["harness"]["commit"]) in (0, 40)


def test_node_mismatch_names_each_field():
    fp = {"cpu": {"arch": "x86_64", "cores": 2}, "gpu": {"count": 0, "devices": []}}
    h200x8 = NodeClass(gpu_model="H200", gpu_count=8, cpu_arch="x86_64", min_cpu_cores=16)
    problems = environment.node_mismatches(fp, h200x8)
    assert [p.split(":")[0] for p in problems] == ["cpu.cores", "gpu.count", "gpu.model"]
    assert environment.node_mismatches(fp, NodeClass(gpu_count=0, cpu_arch="x86_64", min_cpu_cores=2)) == []
    fp8 = {"cpu": {"arch": "x86_64", "cores": 128},
           "gpu": {"count": 8, "devices": [{"name": "NVIDIA H200"}] * 8}}
    assert environment.node_mismatches(fp8, h200x8) == []
    assert environment.comparable(fp, fp8)[0].startswith("cpu.cores")


def test_probe_failures_never_raise(monkeypatch):
    monkeypatch.setattr(environment, "gpus", lambda: 1 / 0)
    fp = environment.fingerprint()
    assert "ZeroDivisionError" in fp["gpu"]["error"]
