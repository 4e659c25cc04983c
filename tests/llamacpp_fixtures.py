"""Test fixtures for the llamacpp engine: a tiny random Kimi K3 GGUF and fake sources (bare git repos, sdists).

The tiny model follows llama.cpp's kimi-k3 loader (src/models/kimi-k3.cpp, load_arch_hparams/_tensors):
layer 0 KDA (dense FFN), layer 1 MLA (latent MoE). Keys are written as raw strings so PyPI gguf (which
lacks the kimi-k3 constants) works. Shapes below are numpy order, i.e. ggml ``ne`` reversed.
"""

from __future__ import annotations

import io
import itertools
import tarfile
from pathlib import Path

import numpy as np

ARCH = "kimi-k3"
TINY = {"n_embd": 64, "n_head": 2, "kda_head_dim": 32, "d_conv": 4, "n_layer": 2,
        "full_attn_layers": (2,),  # 1-indexed MLA layers
        "n_ff": 128, "n_expert": 4, "n_expert_used": 2, "n_ff_exp": 32, "latent": 32, "n_shared": 1,
        "q_lora": 32, "kv_lora": 32, "rope": 8, "nope": 16, "v_dim": 16, "n_merges": 64, "ctx": 4096, "res_block": 1}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _tiny_bpe(n_merges: int) -> tuple[list[str], list[str]]:
    """256 byte symbols + `n_merges` merges learned greedily from a fixed text (deterministic)."""
    alphabet = _bytes_to_unicode()
    text = ("the quick brown fox jumps over the lazy dog while the scoreboard measures the reference "
            "and the candidate on the same box then seals the receipt ") * 4
    words = [[alphabet[b] for b in (" " + w if i else w).encode()] for i, w in enumerate(text.split())]
    tokens = [alphabet[b] for b in range(256)]
    merges: list[str] = []
    while len(merges) < n_merges:
        counts: dict[tuple[str, str], int] = {}
        for w in words:
            for a, b in itertools.pairwise(w):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        (a, b), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [a + b]
                else:
                    i += 1
    return tokens, merges


def write_tiny_kimi_k3(path: Path, seed: int = 0, cfg: dict | None = None) -> dict:
    """Write a loadable tiny kimi-k3 GGUF (F32, random damped weights) to `path`; return its config."""
    import gguf

    c = dict(TINY, **(cfg or {}))
    rng = np.random.default_rng(seed)
    tokens, merges = _tiny_bpe(c["n_merges"])
    tokens += ["[BOS]", "[EOS]"]
    n_vocab = len(tokens)
    E, H, hd, L = c["n_embd"], c["n_head"], c["kda_head_dim"], c["n_layer"]
    d_inner = H * hd
    k_mla = c["nope"] + c["rope"]
    mla = [(il + 1) in c["full_attn_layers"] for il in range(L)]

    w = gguf.GGUFWriter(str(path), ARCH)
    p = f"{ARCH}."
    for key, val in [("context_length", c["ctx"]), ("embedding_length", E), ("block_count", L),
                     ("feed_forward_length", c["n_ff"]), ("attention.head_count", H),
                     ("attention.key_length_mla", k_mla), ("attention.value_length_mla", c["v_dim"]),
                     ("attention.q_lora_rank", c["q_lora"]), ("attention.kv_lora_rank", c["kv_lora"]),
                     ("attention.key_length", c["kv_lora"] + c["rope"]), ("attention.value_length", c["kv_lora"]),
                     ("rope.dimension_count", c["rope"]), ("ssm.conv_kernel", c["d_conv"]),
                     ("kda.head_dim", hd), ("expert_count", c["n_expert"]),
                     ("expert_used_count", c["n_expert_used"]), ("expert_feed_forward_length", c["n_ff_exp"]),
                     ("expert_shared_count", c["n_shared"]), ("leading_dense_block_count", 1),
                     ("expert_gating_func", 2), ("expert_latent_length", c["latent"]),
                     ("attn_res.block_size", c["res_block"]), ("vocab_size", n_vocab)]:
        w.add_uint32(p + key, val)
    for key, val in [("attention.layer_norm_rms_epsilon", 1e-6), ("kda.gate_lower_bound", -5.0),
                     ("expert_weights_scale", 1.0), ("activation.situ_beta", 3.0),
                     ("activation.situ_linear_beta", 3.0)]:
        w.add_float32(p + key, val)
    w.add_bool(p + "expert_weights_norm", True)
    w.add_array(p + "attention.head_count_kv", [1 if m else 0 for m in mla])
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * (n_vocab - 2) + [3, 3])
    w.add_array("tokenizer.ggml.merges", merges)
    w.add_uint32("tokenizer.ggml.bos_token_id", n_vocab - 2)
    w.add_uint32("tokenizer.ggml.eos_token_id", n_vocab - 1)

    def t(name: str, *shape: int, std: float = 0.02, const: float | None = None) -> None:
        a = np.full(shape, const, np.float32) if const is not None else (rng.standard_normal(shape) * std)
        w.add_tensor(name, a.astype(np.float32))

    t("token_embd.weight", n_vocab, E, std=1.0)
    t("output_norm.weight", E, const=1.0)
    t("output.weight", n_vocab, E, std=0.1)
    t("output_res_score.weight", E, std=0.03)
    for il in range(L):
        b = f"blk.{il}."
        t(b + "attn_norm.weight", E, const=1.0)
        t(b + "ffn_norm.weight", E, const=1.0)
        t(b + "attn_res_score.weight", E, std=0.03)
        t(b + "ffn_res_score.weight", E, std=0.03)
        if not mla[il]:  # KDA
            for q in "qkv":
                t(b + f"ssm_conv1d_{q}.weight", d_inner, 1, c["d_conv"], std=0.3)
                t(b + f"attn_{q}.weight", d_inner, E, std=0.1)
            t(b + "ssm_f_a.weight", hd, E, std=0.1)
            t(b + "ssm_f_b.weight", d_inner, hd, std=0.1)
            t(b + "ssm_beta.weight", H, E, std=0.1)
            w.add_tensor(b + "ssm_a", (-np.exp(np.log(rng.uniform(1, 16, H)))).astype(np.float32))
            t(b + "ssm_dt.bias", d_inner, const=0.0)
            t(b + "ssm_g.weight", d_inner, E, std=0.1)
            t(b + "ssm_norm.weight", hd, const=1.0)
            t(b + "attn_output.weight", E, d_inner, std=0.05)
        else:  # MLA (nope-only, absorbed k_b/v_b, sigmoid output gate)
            t(b + "attn_q_a_norm.weight", c["q_lora"], const=1.0)
            t(b + "attn_kv_a_norm.weight", c["kv_lora"], const=1.0)
            t(b + "attn_q_a.weight", c["q_lora"], E, std=0.1)
            t(b + "attn_q_b.weight", H * k_mla, c["q_lora"], std=0.1)
            t(b + "attn_kv_a_mqa.weight", c["kv_lora"] + c["rope"], E, std=0.1)
            t(b + "attn_k_b.weight", H, c["kv_lora"], c["nope"], std=0.1)
            t(b + "attn_v_b.weight", H, c["v_dim"], c["kv_lora"], std=0.1)
            t(b + "attn_gate.weight", H * c["v_dim"], E, std=0.1)
            t(b + "attn_output.weight", E, H * c["v_dim"], std=0.05)
        if il < 1:  # leading dense block
            t(b + "ffn_gate.weight", c["n_ff"], E, std=0.1)
            t(b + "ffn_up.weight", c["n_ff"], E, std=0.1)
            t(b + "ffn_down.weight", E, c["n_ff"], std=0.05)
        else:  # latent MoE + shared expert
            X, F, Z = c["n_expert"], c["n_ff_exp"], c["latent"]
            t(b + "ffn_gate_inp.weight", X, E, std=0.1)
            t(b + "exp_probs_b.bias", X, const=0.0)
            t(b + "ffn_gate_exps.weight", X, F, Z, std=0.1)
            t(b + "ffn_up_exps.weight", X, F, Z, std=0.1)
            t(b + "ffn_down_exps.weight", X, Z, F, std=0.05)
            t(b + "ffn_routed_down.weight", Z, E, std=0.1)
            t(b + "ffn_routed_up.weight", E, Z, std=0.1)
            t(b + "ffn_routed_norm.weight", Z, const=1.0)
            t(b + "ffn_gate_shexp.weight", F * c["n_shared"], E, std=0.1)
            t(b + "ffn_up_shexp.weight", F * c["n_shared"], E, std=0.1)
            t(b + "ffn_down_shexp.weight", E, F * c["n_shared"], std=0.05)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dict(c, n_vocab=n_vocab)


def write_fake_sdist(dest_dir: Path, package: str = "fakellama", version: str = "0.1.0",
                     subdir: str = "vendor/llama.cpp", files: dict[str, str] | None = None) -> Path:
    """A minimal, pip-downloadable sdist (setuptools backend) whose `subdir` holds `files` and a dangling `.git`."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    root = f"{package}-{version}"
    content = {
        "pyproject.toml": '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
                          f'[project]\nname = "{package}"\nversion = "{version}"\n',
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n",
        f"{subdir}/.git": "gitdir: ../../.git/modules/vendor/llama.cpp\n",
        f"{subdir}/README.md": "fake llama.cpp\n",
        "README.md": "outside the subdir\n",
    }
    content.update({f"{subdir}/{k}": v for k, v in (files or {"CMakeLists.txt": "# fake\n"}).items()})
    path = dest_dir / f"{package}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, text in sorted(content.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"{root}/{name}")
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tf.addfile(info, io.BytesIO(data))
    return path


class BareRemote:
    """A bare repository reached by file:// and a work repo that commits trees and pushes refs to it."""

    def __init__(self, root: Path) -> None:
        import git

        self.work = git.Repo.init(root / "work")
        with self.work.config_writer() as cw:
            cw.set_value("user", "name", "llamacpp test")
            cw.set_value("user", "email", "llamacpp@test.invalid")
        self.bare = git.Repo.init(root / "remote.git", bare=True)
        self.url = (root / "remote.git").as_uri()

    def commit(self, files: dict[str, str], message: str, parent: str | None = None) -> str:
        """A commit whose tree is exactly `files`, on `parent` (None: a new root); HEAD does not move."""
        wd = Path(self.work.working_dir)
        self.work.git.rm("-r", "-q", "--cached", "--ignore-unmatch", ".")
        for name, text in files.items():
            (wd / name).parent.mkdir(parents=True, exist_ok=True)
            (wd / name).write_text(text)
            self.work.git.add(name)
        tree = self.work.git.write_tree()
        return self.work.git.commit_tree(tree, "-m", message, *(["-p", parent] if parent else []))

    def push(self, sha: str, ref: str) -> None:
        self.work.git.push(self.url, f"+{sha}:{ref}")

    def delete(self, ref: str) -> None:
        self.work.git.push(self.url, f":{ref}")


# ----------------------------------------------------------------------------------------------
# the one real build shared by every llamacpp test (cached across runs: CI keeps the cache dir)

REPO = Path(__file__).resolve().parent.parent


def test_cache_dir() -> Path:
    """The same cache the CLI uses ($SCOREBOARD_CACHE, else ~/.cache/scoreboard): builds are keyed by
    what they depend on and re-verified, so tests and `scoreboard round run` share one build."""
    from scoreboard.weights.verify import default_cache

    return default_cache()


test_cache_dir.__test__ = False  # not a test, despite the name


def pinned_sdist_reference():
    """(id, reference) of the first pypi-sdist reference in the repo's reference.lock."""
    from scoreboard.lockfile import SdistReference, load_lock

    lock = load_lock(REPO / "reference.lock")
    for rid, ref in lock.references.items():
        if isinstance(ref, SdistReference):
            return rid, ref
    raise LookupError("reference.lock has no pypi-sdist reference")


def tiny_target(model: Path, geometry=None, shards: tuple[Path, ...] | None = None, **options):
    from scoreboard.engine import EngineTarget, Geometry

    rid, ref = pinned_sdist_reference()
    return EngineTarget(target_id="k3-tiny-test", model_path=model, shard_paths=shards or (model,), device="cpu",
                        geometry=geometry or Geometry(n_ctx=2048, n_batch=512, n_ubatch=128, n_threads=2),
                        reference=ref, options={"reference_id": rid, **options})


def tiny_model(out_dir: Path) -> tuple[Path, ...]:
    """The default tiny Kimi K3 (`k3-mini` from scoreboard.weights, 3 shards); this module's writer if absent."""
    try:
        from scoreboard.weights.generate import generate
    except ImportError:
        path = out_dir / "k3-tiny.gguf"
        write_tiny_kimi_k3(path)
        return (path,)
    return tuple(generate("k3-mini", out_dir))


_PREPARED: dict = {}


def prepared_reference(tmp_root: Path):
    """(engine, target, prepared) for the tiny model on the pinned sdist build; built once per process."""
    from engines.llamacpp.engine import LlamaCppEngine

    if "p" not in _PREPARED:
        shards = tiny_model(tmp_root)
        engine, target = LlamaCppEngine(), tiny_target(shards[0], shards=shards)
        _PREPARED["p"] = (engine, target, engine.prepare(target, test_cache_dir()))
    return _PREPARED["p"]
