"""Compile every sparkinfer Triton kernel for sm_90 with the installed Triton, on a machine with no GPU.

Triton's compiler (MLIR -> LLVM -> PTX -> its bundled ptxas) needs no device: this catches a kernel the
interpreter accepts but the compiler rejects, and reads what ptxas allocated (registers, stack = spills) with
Triton's bundled cuobjdump. Widths are a generated preset's (default k3-gpu), launch options the wrappers'
(kernels.WARPS and the block constants). Run with TRITON_INTERPRET unset:

    python bench/triton_compile.py --preset k3-gpu [--json out.json]

A compile is not a run: nothing here says the kernels are fast or right on a GPU (the engine's self-check
at prepare and the rounds do).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("bench/triton_compile.py: unset TRITON_INTERPRET (the interpreter compiles nothing)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engines.sparkinfer import kernels as K  # noqa: E402
from scoreboard.weights.presets import get_spec  # noqa: E402

P, H, I64 = "*fp32", "*fp16", "*i64"


def vec_tiles() -> list[tuple[int, int]]:
    """Every (rows, warps) K.vec_blocks can pick, read from the rule itself over a grid of product shapes (rows
    16..32768, a short and a long reduction); compiled at its widest step, 1024, the most registers per row."""
    return sorted({(bn, w) for n in range(16, 32769, 16) for k in (512, 1024) for bn, _, w in [K.vec_blocks(n, k)]})


Case = tuple  # (label, kernel, signature, constexprs, warps[, stages]): stages as Triton's default (3) if absent


def cases(name: str) -> list[Case]:
    """(label, kernel, signature, constexprs, warps[, pipeline stages]) for every kernel at the preset's widths."""
    c = get_spec(name).config()
    e, f, lat, k = c.n_embd, c.expert_ff, c.expert_latent_length, c.n_expert_used
    hd, kvr, rope, nope, v = c.kda_head_dim, c.kv_lora_rank, c.rope_dim, c.qk_nope_dim, c.value_length_mla
    rows = -(-c.n_layer // c.attn_res_block_size) + 1 if c.attn_res_block_size > 0 else 2
    cp = triton.next_power_of_2(rows)
    out: list[Case] = []
    lv = {"x_ptr": P, "w_ptr": H, "out_ptr": P, "norm_ptr": P, "add_ptr": P, "N": "i32", "K": "i32", "eps": "fp32",
          "HAS_NORM": "constexpr", "HAS_ADD": "constexpr", "BN": "constexpr", "BK": "constexpr"}
    for norm, add in ((False, False), (True, False), (False, True), (True, True)):
        for bn, warps in vec_tiles():
            out.append((f"linear_vec norm={norm} add={add} bn={bn} warps={warps}", K._linear_vec, lv,
                        {"BN": bn, "BK": 1024, "HAS_NORM": norm, "HAS_ADD": add}, warps))
    out.append(("linear_vec f32 router", K._linear_vec, {**lv, "w_ptr": P},
                {"BN": 2, "BK": 1024, "HAS_NORM": True, "HAS_ADD": False}, 8))
    out.append(("experts_in_situ", K._experts_in_situ,
                {"x_ptr": P, "w_ptr": H, "sel_ptr": I64, "out_ptr": P, "inv_beta": "fp32", "inv_lb": "fp32",
                 "beta_lb": "fp32", "F": "constexpr", "LAT": "constexpr", "LINEAR_UP": "constexpr", "BF": "constexpr",
                 "BK": "constexpr"},
                {"F": f, "LAT": lat, "LINEAR_UP": False, "BF": K.BLOCK_F, "BK": K.in_situ_tile(lat)[0]},
                K.in_situ_tile(lat)[1]))
    out.append(("experts_down_sum", K._experts_down_sum,
                {"a_ptr": P, "w_ptr": H, "sel_ptr": I64, "wts_ptr": P, "out_ptr": P, "K_USED": "constexpr",
                 "KP": "constexpr", "F": "constexpr", "LAT": "constexpr", "BL": "constexpr", "BK": "constexpr"},
                dict(zip(("KP", "BK"), K.down_sum_tile(k, f)), K_USED=k, F=f, LAT=lat, BL=K.BLOCK_L),
                K.WARPS["experts_down_sum"]))
    out.append(("route", K._route,
                {"logits_ptr": P, "bias_ptr": P, "sel_ptr": I64, "wts_ptr": P, "wsum_min": "fp32", "scale": "fp32",
                 "X": "constexpr", "K_USED": "constexpr", "BX": "constexpr", "SIGMOID": "constexpr",
                 "NORM": "constexpr", "SCALE": "constexpr"},
                {"X": c.n_expert, "K_USED": k, "BX": triton.next_power_of_2(c.n_expert), "SIGMOID": True, "NORM": True,
                 "SCALE": True}, 4))
    out.append(("situ", K._situ, {"h_ptr": P, "out_ptr": P, "inv_beta": "fp32", "inv_lb": "fp32", "beta_lb": "fp32",
                                  "F": "i32", "LINEAR_UP": "constexpr", "BF": "constexpr"},
                {"LINEAR_UP": False, "BF": K.BLOCK_SITU}, 4))
    be, cols = K.res_mix_blocks(e, cp)
    out.append(("res_mix", K._res_mix, {"bank_ptr": P, "cur_ptr": P, "score_ptr": P, "out_ptr": P, "C": "i32",
                                        "eps": "fp32", "E": "constexpr", "CP": "constexpr", "BE": "constexpr",
                                        "COLS": "constexpr"},
                {"E": e, "CP": cp, "BE": be, "COLS": cols}, 4))
    kda = {n: P for n in ("q_ptr", "k_ptr", "v_ptr", "gf_ptr", "beta_ptr", "gout_ptr", "conv_ptr", "convw_ptr",
                          "na_ptr", "dtna_ptr", "s_ptr", "norm_ptr", "out_ptr")}
    kda.update({"lower_bound": "fp32", "eps": "fp32", "scale": "fp32", "DI": "constexpr", "HD": "constexpr",
                "KC": "constexpr"})
    out.append(("kda_step", K._kda_step, kda, {"DI": c.n_head * hd, "HD": hd, "KC": c.ssm_conv_kernel},
                K.WARPS["kda_step"]))
    out.append(("mla_qabs", K._mla_qabs, {"q_ptr": P, "wkb_ptr": H, "kv_ptr": P, "norm_ptr": P, "lat_ptr": H,
                                          "pos_ptr": I64, "qa_ptr": P, "eps": "fp32", "KVR": "constexpr",
                                          "ROPE": "constexpr", "NOPE": "constexpr", "BC": "constexpr"},
                {"KVR": kvr, "ROPE": rope, "NOPE": nope, "BC": min(kvr, 32)}, 4))
    split = {"qa_ptr": P, "lat_ptr": H, "pos_ptr": I64, "m_ptr": P, "l_ptr": P, "acc_ptr": P, "H": "i32",
             "n_split": "i32", "rows_min": "i32", "qscale": "fp32", "KVR": "constexpr", "ROPE": "constexpr", "BH": "constexpr",
             "BT": "constexpr", "Q_SPLIT": "constexpr", "P_SPLIT": "constexpr"}
    causal = {"qa_ptr": P, "lat_ptr": H, "out_ptr": P, "n_rows": "i32", "H": "i32", "pos0": "i32", "qscale": "fp32",
              "KVR": "constexpr", "ROPE": "constexpr", "BM": "constexpr", "BT": "constexpr", "Q_SPLIT": "constexpr",
              "P_SPLIT": "constexpr"}
    for p_split in (False, True):  # the engine's choice (kernels.MLA_P_SPLIT) and the other
        out.append((f"mla_split p_split={p_split}", K._mla_split, split,
                    {"KVR": kvr, "ROPE": rope, "BH": K.MLA_BH, "BT": K.MLA_BT, "Q_SPLIT": True, "P_SPLIT": p_split},
                    K.WARPS["mla_split"], K.STAGES["mla_split"]))
        out.append((f"mla_split_rows p_split={p_split}", K._mla_split_rows, split,
                    {"KVR": kvr, "ROPE": rope, "BH": K.MLA_ROWS_BH, "BT": K.MLA_BT, "Q_SPLIT": K.MLA_DECODE_Q_SPLIT,
                     "P_SPLIT": p_split}, K.WARPS["mla_split_rows"], K.STAGES["mla_split_rows"]))
        for q_split in (False, True):
            out.append((f"mla_causal q_split={q_split} p_split={p_split}", K._mla_causal, causal,
                        {"KVR": kvr, "ROPE": rope, "BM": K.MLA_BM, "BT": K.MLA_CAUSAL_BT, "Q_SPLIT": q_split,
                         "P_SPLIT": p_split}, K.WARPS["mla_causal"], K.STAGES["mla_causal"]))
    out.append(("mla_combine", K._mla_combine, {"m_ptr": P, "l_ptr": P, "acc_ptr": P, "pos_ptr": I64, "olat_ptr": P,
                                                "H": "i32", "n_split": "i32", "rows_min": "i32", "KVR": "constexpr",
                                                "BT": "constexpr", "BS": "constexpr", "BC": "constexpr"},
                {"KVR": kvr, "BT": K.MLA_BT, "BS": K.MLA_COMBINE_SPLITS, "BC": min(kvr, K.MLA_COMBINE_COLS)}, 4))
    out.append(("mla_vout", K._mla_vout, {"olat_ptr": P, "wvb_ptr": H, "gate_ptr": P, "out_ptr": P,
                                          "HAS_GATE": "constexpr", "KVR": "constexpr", "V": "constexpr",
                                          "BV": "constexpr"},
                {"HAS_GATE": True, "KVR": kvr, "V": v, "BV": min(v, 32)}, 4))
    out.append(("chunk_scan", K._chunk_scan, {"u0_ptr": P, "w_ptr": P, "kt_ptr": P, "dec_ptr": P, "s_ptr": P,
                                              "starts_ptr": P, "us_ptr": P, "N": "i32", "H": "constexpr",
                                              "C": "constexpr", "DK": "constexpr", "DV": "constexpr", "BV": "constexpr"},
                {"H": c.n_head, "C": 16, "DK": hd, "DV": hd, "BV": min(hd, K.SCAN_BV)}, K.WARPS["chunk_scan"]))
    out.append(("grouped_mm", K._grouped_mm, {"x_ptr": H, "w_ptr": H, "tiles_ptr": "*i32", "out_ptr": P, "N": "i32",
                                              "K": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
                {"BM": K.GMM_BM, "BN": K.GMM_BN, "BK": K.GMM_BK}, K.WARPS["grouped_mm"], K.STAGES["grouped_mm"]))
    return out


def resources(cubin: bytes) -> dict[str, int]:
    """REG and STACK of the one kernel in a cubin, from Triton's bundled cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", fh.name], capture_output=True, text=True).stdout
    got: dict[str, int] = {}
    for word in text.split():
        key, _, val = word.partition(":")
        if key in ("REG", "STACK") and val.isdigit():
            got[key.lower()] = int(val)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-gpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    target = GPUTarget("cuda", 90, 32)
    rows = []
    for label, fn, sig, const, warps, *stages in cases(args.preset):
        t0 = time.perf_counter()
        try:
            ck = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=target,
                                options={"num_warps": warps, "num_stages": stages[0] if stages else 3})
            row = {"kernel": label, "ok": True, **resources(ck.asm["cubin"])}
        except Exception as exc:  # report every kernel, not only the first failure
            row = {"kernel": label, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    res = {"triton": triton.__version__, "preset": args.preset, "target": "sm_90", "kernels": rows,
           "all_ok": all(r["ok"] for r in rows), "seconds": round(sum(r["seconds"] for r in rows), 1)}
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("triton", "preset", "all_ok", "seconds")}))
    return 0 if res["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
