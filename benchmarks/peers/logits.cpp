// pd-logits: llama.cpp's next-token logits at every position of token sequences given as ids
// (teacher-forced: each sequence decoded as one batch in a fresh context, no tokenizer in the
// loop), so pagedecode's distributions can be compared with llama.cpp's on the same GGUF file.
//
//   pd-logits MODEL.gguf THREADS OUT.bin [KV_TYPE [FLASH]] < sequences.txt
//
// stdin: one sequence a line, token ids separated by spaces. OUT.bin: for each sequence in order,
// its (length, n_vocab) float32 logits, row i the distribution after tokens 0..i (little-endian,
// no header: the caller knows the lengths). stdout: n_vocab.
// KV_TYPE: f16 (llama.cpp's default cache, the default here) or f32. FLASH: auto (the default, as
// llama.cpp's tools run), on or off. Both exist to tell llama.cpp's own rounding (a float16 cache,
// flash attention's float16 accumulator of V) from a difference in the model.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4 || argc > 6) {
        std::fprintf(stderr, "usage: %s MODEL.gguf THREADS OUT.bin [f16|f32 [auto|on|off]] < sequences (token ids, one a line)\n", argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[2]);
    const std::string kv = argc > 4 ? argv[4] : "f16";
    const std::string flash = argc > 5 ? argv[5] : "auto";
    if ((kv != "f16" && kv != "f32") || (flash != "auto" && flash != "on" && flash != "off")) {
        std::fprintf(stderr, "KV_TYPE is f16 or f32, FLASH auto, on or off\n");
        return 2;
    }
    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
    }, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) { std::fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    FILE * out = std::fopen(argv[3], "wb");
    if (!out) { std::fprintf(stderr, "cannot write %s\n", argv[3]); return 1; }
    std::string line;
    while (std::getline(std::cin, line)) {
        std::vector<llama_token> seq;
        std::istringstream in(line);
        for (llama_token t; in >> t;) seq.push_back(t);
        if (seq.empty()) continue;
        const int n = (int) seq.size();
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = n + 16;
        cp.n_batch = cp.n_ubatch = cp.n_ctx;
        cp.n_threads = cp.n_threads_batch = threads;
        cp.type_k = cp.type_v = kv == "f32" ? GGML_TYPE_F32 : GGML_TYPE_F16;
        cp.flash_attn_type = flash == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                           : flash == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
        cp.no_perf = true;
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) { std::fprintf(stderr, "cannot create a context\n"); return 1; }
        llama_batch batch = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            batch.token[i] = seq[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;          // every position's distribution, not only the last
        }
        batch.n_tokens = n;
        if (llama_decode(ctx, batch) != 0) { std::fprintf(stderr, "llama_decode failed\n"); return 1; }
        for (int i = 0; i < n; i++) {
            const float * logits = llama_get_logits_ith(ctx, i);
            if (std::fwrite(logits, sizeof(float), n_vocab, out) != (size_t) n_vocab) {
                std::fprintf(stderr, "short write to %s\n", argv[3]);
                return 1;
            }
        }
        llama_batch_free(batch);
        llama_free(ctx);
    }
    std::fclose(out);
    std::printf("%d\n", n_vocab);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
