"""The worker pipe's typed, versioned request and result (scoreboard/worker/protocol.py) and the worker's
handling of a request it cannot read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scoreboard.engine import EngineTarget, Geometry, Workload
from scoreboard.worker import serve
from scoreboard.worker.protocol import (
    PROTOCOL,
    CheckedOp,
    CheckedRun,
    GateOp,
    LogitsFile,
    LogitsOp,
    LogitsRows,
    PeakMemory,
    ProtocolError,
    TimedOp,
    WireGeometry,
    WireTarget,
    WorkerRequest,
    WorkerResult,
    check_result,
    decode_request,
    decode_result,
    encode,
)

GEOM = Geometry(256, 64, 64, 1)
TARGET = EngineTarget("t", Path("/w/a.gguf"), (Path("/w/a.gguf"), Path("/w/b.gguf")), "cpu", GEOM,
                      options={"faults": ["x"], "dtype": "float32"}, ranks=2)
WL = Workload("decode", 3, 2, (5, 6))


def _request(op) -> WorkerRequest:
    return WorkerRequest(engine="toy", entry_point="engines.toy.engine:ToyEngine", target=WireTarget.of(TARGET),
                         cache_dir="/sb/cache", timeout_s=60, op=op)


@pytest.mark.parametrize("op", [
    TimedOp.of([WL, Workload("prefill", 2, 3, (1, 2))], [3, 1]),
    LogitsOp(requests=(LogitsRows.of([1, 2, 3], [0, 2]),)),
    CheckedOp(checked=(CheckedRun.of(WL, [(9,), (8,)]),)),
    GateOp(requests=(LogitsRows.of([1, 2], [1]),), checked=(CheckedRun.of(WL, [[7]]),)),
])
def test_every_op_round_trips_and_gives_back_the_engine_values(op):
    req = _request(op)
    back = decode_request(encode(req))
    assert back == req and json.loads(encode(req))["protocol"] == PROTOCOL
    assert back.target.target() == TARGET
    if isinstance(back.op, TimedOp):
        assert back.op.workloads[0].workload() == WL


def test_a_result_round_trips():
    res = WorkerResult(ok=True, rank=0, pid=12, at_ns=34, identity={"engine": "toy", "extra": {"a": [1]}},
                       engine_module="engines.toy.engine", engine_file="/sb/arm/engines/toy/engine.py",
                       logits=[LogitsFile(path="/s/logits-0.npy", geometry=WireGeometry.of(GEOM))],
                       checked=[[[1, 2], [3, 4]]], peak_memory=[PeakMemory(rank=0, host_rss_gib=0.5, device_gib=None)])
    assert decode_result(encode(res)) == res
    assert res.peak_memory[0].as_dict() == {"rank": 0, "host_rss_gib": 0.5, "device_gib": None}


def test_another_version_is_refused_by_its_field():
    text = json.dumps({**json.loads(encode(_request(LogitsOp(requests=())))), "protocol": "scoreboard-worker/1"})
    with pytest.raises(ProtocolError, match=r"^worker request\.protocol: 'scoreboard-worker/1', this harness speaks "
                                            r"'scoreboard-worker/2'$"):
        decode_request(text)
    with pytest.raises(ProtocolError, match=r"^worker result\.protocol: None, this harness speaks"):
        decode_result('{"ok": true}')  # an unversioned (pre-protocol) result


def test_malformed_fields_are_named_with_their_path_all_at_once():
    body = json.loads(encode(_request(GateOp(requests=(LogitsRows.of([1, 2], [1]),), checked=()))))
    body["op"]["requests"][0]["positions"] = [1, "2", True]
    body["target"]["ranks"] = 1.5
    body["surprise"] = 1
    with pytest.raises(ProtocolError) as exc:
        decode_request(json.dumps(body))
    msg = exc.value.message
    assert msg.startswith("worker request: ")
    for path in ("op.requests.0.positions.1: Input should be a valid integer",
                 "op.requests.0.positions.2: Input should be a valid integer",
                 "target.ranks: Input should be a valid integer", "surprise: Extra inputs are not permitted"):
        assert path in msg, msg
    body = json.loads(encode(_request(LogitsOp(requests=()))))
    body["op"]["kind"] = "bench"
    with pytest.raises(ProtocolError, match=r"op: Input tag 'bench' found using 'kind' does not match"):
        decode_request(json.dumps(body))
    for text, says in (("[1]", "expected a JSON object, got list"), ("{", "not JSON")):
        with pytest.raises(ProtocolError, match=says):
            decode_result(text)


def test_timed_reps_pair_with_workloads_and_one_engine_is_named():
    with pytest.raises(ValueError, match="1 workloads but 2 rep counts"):
        TimedOp.of([WL], [1, 2])
    with pytest.raises(ValueError, match="exactly one of entry_point and harness_engine"):
        WorkerRequest(engine="toy", entry_point="a:B", harness_engine="null", target=WireTarget.of(TARGET),
                      cache_dir="", timeout_s=1, op=LogitsOp(requests=()))


def test_a_successful_result_must_carry_what_its_op_produces():
    op = GateOp(requests=(LogitsRows.of([1], [0]), LogitsRows.of([2], [0])), checked=())
    with pytest.raises(ProtocolError) as exc:
        check_result(op, WorkerResult(ok=True, logits=[LogitsFile(path="x", geometry=WireGeometry.of(GEOM))]))
    assert exc.value.message == ("worker result: identity: missing (every successful op prepared an engine); "
                                 "logits: op gate asked for 2 logits file(s), got 1; checked: op gate asked for 0 "
                                 "checked run(s), got none")
    check_result(TimedOp.of([WL], [1]), WorkerResult(ok=True, identity={}))


def test_the_worker_answers_a_request_of_another_version_with_a_failure_naming_it(tmp_path):
    req, res = tmp_path / "request.json", tmp_path / "result.json"
    req.write_text(json.dumps({"protocol": "scoreboard-worker/0", "engine": "toy"}))
    assert serve.main([str(req), str(res)]) == 3
    out = decode_result(res.read_text())
    assert not out.ok and out.error.startswith("worker request.protocol: 'scoreboard-worker/0'") and out.pid > 0
