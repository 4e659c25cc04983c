// scoreboard-dump-logits: float32 next-token logits of a pinned llama.cpp build, for the correctness gate.
//
// Feeds the token ids of --tokens (int32 LE, in order from position 0) through libllama's public API with
// the given context geometry, and writes the logits row of every position listed in --positions (int32 LE,
// strictly increasing) to --out:
//
//   header (little endian):  char magic[8] = "SBLOGIT1", uint32 version = 1, uint32 header_bytes,
//                            int32 n_vocab, int32 n_rows, int32 n_tokens,
//                            uint32 n_ctx, n_batch, n_ubatch, int32 n_threads, int32 flash_attn, int32 n_gpu_layers
//   int32  positions[n_rows]
//   float  logits[n_rows][n_vocab]
//
// The geometry actually used (llama.cpp pads n_ctx to 256 and clamps n_batch to n_ctx) is also printed to
// stdout as one JSON line. Exit codes: 0 ok, 2 bad arguments/input, 3 model load failed, 4 context failed,
// 5 decode failed, 6 write failed.
//
// Several sequences in one run (--lengths: int32 per sequence, their tokens back to back in --tokens; --counts:
// int32 rows per sequence, each sequence's positions back to back in --positions, relative to its own start):
// the model loads once, the longest prefix every sequence shares (cut down to a multiple of n_batch and to
// before the first position any sequence asks for) is decoded once and its context state saved
// (llama_state_seq_get_data, as llama-bench -d does for its depth); each sequence then starts from that state
// restored and decodes the rest in chunks of n_batch from the same absolute positions a run of that sequence
// alone uses, so its rows are the ones a run of it alone writes. Rows come out sequence by sequence; n_tokens
// in the header is the sum of the lengths.

#include "llama.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Args {
    std::string model, tokens, positions, out, lengths, counts;
    long n_ctx = 0, n_batch = 0, n_ubatch = 0, threads = 0, n_gpu_layers = 0, flash_attn = -1;
    std::string split_mode = "layer";  // llama.cpp's own split over the visible GPUs: none | layer | row
};

[[noreturn]] void die(int code, const char * fmt, const char * what) {
    std::fprintf(stderr, "scoreboard-dump-logits: ");
    std::fprintf(stderr, fmt, what);
    std::fprintf(stderr, "\n");
    std::exit(code);
}

long to_long(const char * flag, const char * v) {
    char * end = nullptr;
    errno = 0;
    const long x = std::strtol(v, &end, 10);
    if (errno != 0 || end == v || *end != '\0') {
        die(2, "bad integer for %s", flag);
    }
    return x;
}

Args parse(int argc, char ** argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        const std::string k = argv[i];
        if (i + 1 >= argc) {
            die(2, "missing value for %s", argv[i]);
        }
        const char * v = argv[++i];
        if (k == "--model") a.model = v;
        else if (k == "--tokens") a.tokens = v;
        else if (k == "--positions") a.positions = v;
        else if (k == "--out") a.out = v;
        else if (k == "--lengths") a.lengths = v;
        else if (k == "--counts") a.counts = v;
        else if (k == "--n-ctx") a.n_ctx = to_long("--n-ctx", v);
        else if (k == "--n-batch") a.n_batch = to_long("--n-batch", v);
        else if (k == "--n-ubatch") a.n_ubatch = to_long("--n-ubatch", v);
        else if (k == "--threads") a.threads = to_long("--threads", v);
        else if (k == "--n-gpu-layers") a.n_gpu_layers = to_long("--n-gpu-layers", v);
        else if (k == "--flash-attn") a.flash_attn = to_long("--flash-attn", v);
        else if (k == "--split-mode") a.split_mode = v;
        else die(2, "unknown argument %s", argv[i - 1]);
    }
    if (a.model.empty() || a.tokens.empty() || a.positions.empty() || a.out.empty()) {
        die(2, "%s", "--model, --tokens, --positions and --out are required");
    }
    if (a.n_ctx <= 0 || a.n_batch <= 0 || a.n_ubatch <= 0 || a.threads <= 0) {
        die(2, "%s", "--n-ctx, --n-batch, --n-ubatch and --threads must be > 0");
    }
    if (a.flash_attn < -1 || a.flash_attn > 1) {
        die(2, "%s", "--flash-attn must be -1 (auto), 0 or 1");
    }
    if (a.lengths.empty() != a.counts.empty()) {
        die(2, "%s", "--lengths and --counts go together");
    }
    return a;
}

std::vector<int32_t> read_i32(const std::string & path) {
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) die(2, "cannot open %s", path.c_str());
    std::vector<int32_t> v;
    int32_t x;
    while (std::fread(&x, sizeof x, 1, f) == 1) v.push_back(x);
    std::fclose(f);
    return v;
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        std::fputs(text, stderr);
    }
}

struct Seq {
    size_t tok0, len;   // its tokens: tokens[tok0, tok0 + len)
    size_t row0, rows;  // its positions: positions[row0, row0 + rows), relative to tok0
};

// decode seq's tokens [from, len) in chunks of n_batch starting at `from` (a multiple of n_batch, so the chunks
// are the ones a run of the whole sequence uses), copying the rows it asks for into out; 0 or llama_decode's code
int decode_range(llama_context * ctx, llama_batch & batch, int32_t n_batch, const std::vector<int32_t> & tokens,
                 const std::vector<int32_t> & positions, const Seq & s, size_t from, int32_t n_vocab,
                 std::vector<float> & out) {
    size_t next_row = 0;
    while (next_row < s.rows && (size_t) positions[s.row0 + next_row] < from) ++next_row;
    for (size_t start = from; start < s.len; start += (size_t) n_batch) {
        const size_t end = std::min(s.len, start + (size_t) n_batch);
        batch.n_tokens = 0;
        std::vector<size_t> rows_here;  // batch index of each requested row in this chunk
        for (size_t p = start; p < end; ++p) {
            const int32_t i = batch.n_tokens++;
            batch.token[i] = tokens[s.tok0 + p];
            batch.pos[i] = (llama_pos) p;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            const size_t r = next_row + rows_here.size();
            const bool want = r < s.rows && (size_t) positions[s.row0 + r] == p;
            batch.logits[i] = want ? 1 : 0;
            if (want) rows_here.push_back((size_t) i);
        }
        const int32_t rc = llama_decode(ctx, batch);
        if (rc != 0) {
            std::fprintf(stderr, "scoreboard-dump-logits: llama_decode returned %d at tokens [%zu, %zu)\n", rc, start, end);
            return rc;
        }
        for (size_t r = 0; r < rows_here.size(); ++r) {
            const float * row = llama_get_logits_ith(ctx, (int32_t) rows_here[r]);
            if (!row) die(5, "%s", "llama_get_logits_ith returned null");
            std::memcpy(out.data() + (s.row0 + next_row + r) * (size_t) n_vocab, row, sizeof(float) * (size_t) n_vocab);
        }
        next_row += rows_here.size();
    }
    return next_row == s.rows ? 0 : -1;
}

}  // namespace

int main(int argc, char ** argv) {
    const Args a = parse(argc, argv);
    const std::vector<int32_t> tokens = read_i32(a.tokens);
    const std::vector<int32_t> positions = read_i32(a.positions);
    if (tokens.empty() || positions.empty()) die(2, "%s", "empty --tokens or --positions");
    std::vector<Seq> seqs;
    if (a.lengths.empty()) {
        seqs.push_back({0, tokens.size(), 0, positions.size()});
    } else {
        const std::vector<int32_t> lengths = read_i32(a.lengths), counts = read_i32(a.counts);
        if (lengths.empty() || lengths.size() != counts.size()) die(2, "%s", "--lengths and --counts differ in size");
        size_t t0 = 0, r0 = 0;
        for (size_t i = 0; i < lengths.size(); ++i) {
            if (lengths[i] <= 0 || counts[i] <= 0) die(2, "%s", "every sequence needs a token and a row");
            seqs.push_back({t0, (size_t) lengths[i], r0, (size_t) counts[i]});
            t0 += (size_t) lengths[i];
            r0 += (size_t) counts[i];
        }
        if (t0 != tokens.size() || r0 != positions.size()) die(2, "%s", "--lengths/--counts do not add up");
    }
    for (const Seq & s : seqs) {
        for (size_t i = 0; i < s.rows; ++i) {
            const int32_t p = positions[s.row0 + i];
            if (p < 0 || (size_t) p >= s.len || (i > 0 && p <= positions[s.row0 + i - 1])) {
                die(2, "%s", "positions must be strictly increasing and inside the token sequence");
            }
        }
        if ((long) s.len > a.n_ctx) die(2, "%s", "more tokens than --n-ctx");
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = (int32_t) a.n_gpu_layers;
    if (a.split_mode == "none") mp.split_mode = LLAMA_SPLIT_MODE_NONE;
    else if (a.split_mode == "layer") mp.split_mode = LLAMA_SPLIT_MODE_LAYER;
    else if (a.split_mode == "row") mp.split_mode = LLAMA_SPLIT_MODE_ROW;
    else die(2, "--split-mode must be none, layer or row, not %s", a.split_mode.c_str());
    llama_model * model = llama_model_load_from_file(a.model.c_str(), mp);
    if (!model) die(3, "failed to load model %s", a.model.c_str());
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int32_t n_vocab = llama_vocab_n_tokens(vocab);
    for (int32_t t : tokens) {
        if (t < 0 || t >= n_vocab) die(2, "%s", "token id outside the model's vocabulary");
    }

    // same defaults as llama-bench (llama_context_default_params), geometry and threads pinned
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) a.n_ctx;
    cp.n_batch = (uint32_t) a.n_batch;
    cp.n_ubatch = (uint32_t) a.n_ubatch;
    cp.n_threads = (int32_t) a.threads;
    cp.n_threads_batch = (int32_t) a.threads;
    cp.flash_attn_type = (llama_flash_attn_type) a.flash_attn;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die(4, "%s", "failed to create the context (geometry or memory)");

    const uint32_t n_ctx = llama_n_ctx(ctx), n_batch = llama_n_batch(ctx), n_ubatch = llama_n_ubatch(ctx);
    const size_t n_rows = positions.size();
    std::vector<float> out(n_rows * (size_t) n_vocab);

    // the prefix every sequence shares, cut to a multiple of n_batch and to before any sequence's first row
    size_t shared = seqs[0].len;
    for (const Seq & s : seqs) {
        size_t k = 0;
        const size_t lim = std::min(s.len, seqs[0].len);
        while (k < lim && tokens[s.tok0 + k] == tokens[seqs[0].tok0 + k]) ++k;
        shared = std::min({shared, k, (size_t) positions[s.row0]});
    }
    shared = seqs.size() > 1 ? shared / n_batch * n_batch : 0;

    llama_batch batch = llama_batch_init((int32_t) n_batch, 0, 1);
    std::vector<uint8_t> state;
    if (shared > 0) {
        const Seq prefix = {seqs[0].tok0, shared, 0, 0};
        if (decode_range(ctx, batch, (int32_t) n_batch, tokens, positions, prefix, 0, n_vocab, out) != 0) return 5;
        state.resize(llama_state_seq_get_size(ctx, 0));
        if (state.empty() || llama_state_seq_get_data(ctx, state.data(), state.size(), 0) != state.size()) state.clear();
    }
    size_t restored = 0;
    for (size_t i = 0; i < seqs.size(); ++i) {
        size_t from = 0;
        if (shared > 0 && !state.empty() && (i == 0 ||
                (llama_memory_clear(llama_get_memory(ctx), false),
                 llama_state_seq_set_data(ctx, state.data(), state.size(), 0) == state.size()))) {
            from = shared;  // the first sequence continues the prefix it decoded; later ones restore it
            restored += i > 0;
        } else {
            llama_memory_clear(llama_get_memory(ctx), false);
        }
        const int rc = decode_range(ctx, batch, (int32_t) n_batch, tokens, positions, seqs[i], from, n_vocab, out);
        if (rc > 0) return 5;
        if (rc < 0) die(5, "%s", "not every requested position produced a row");
    }

    FILE * f = std::fopen(a.out.c_str(), "wb");
    if (!f) die(6, "cannot write %s", a.out.c_str());
    const char magic[8] = {'S', 'B', 'L', 'O', 'G', 'I', 'T', '1'};
    const uint32_t version = 1, header_bytes = 8 + 4 * 11;
    const int32_t hdr_i[3] = {n_vocab, (int32_t) n_rows, (int32_t) tokens.size()};
    const uint32_t geo[3] = {n_ctx, n_batch, n_ubatch};
    const int32_t run[3] = {llama_n_threads(ctx), (int32_t) a.flash_attn, (int32_t) a.n_gpu_layers};
    bool ok = std::fwrite(magic, 1, 8, f) == 8 && std::fwrite(&version, 4, 1, f) == 1 &&
              std::fwrite(&header_bytes, 4, 1, f) == 1 && std::fwrite(hdr_i, 4, 3, f) == 3 &&
              std::fwrite(geo, 4, 3, f) == 3 && std::fwrite(run, 4, 3, f) == 3 &&
              std::fwrite(positions.data(), 4, n_rows, f) == n_rows &&
              std::fwrite(out.data(), sizeof(float), out.size(), f) == out.size();
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) die(6, "short write to %s", a.out.c_str());

    std::printf("{\"n_vocab\": %d, \"n_rows\": %zu, \"n_tokens\": %zu, \"n_ctx\": %u, \"n_batch\": %u, "
                "\"n_ubatch\": %u, \"n_threads\": %d, \"flash_attn\": %ld, \"n_gpu_layers\": %ld, "
                "\"split_mode\": \"%s\", \"n_sequences\": %zu, \"shared_prefix\": %zu, \"restored\": %zu}\n",
                n_vocab, n_rows, tokens.size(), n_ctx, n_batch, n_ubatch, llama_n_threads(ctx), a.flash_attn,
                a.n_gpu_layers, a.split_mode.c_str(), seqs.size(), shared, restored);

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
