// pd-greedy: llama.cpp's greedy tokens for prompts given as token ids (no tokenizer in the loop),
// so benchmarks/quantized.py can compare them with pagedecode's on the same GGUF file.
//
//   pd-greedy MODEL.gguf N_NEW THREADS [KV_TYPE [FLASH]] < prompts.txt
//
// stdin: one prompt per line, token ids separated by spaces. stdout: per prompt, one line of the
// N_NEW token ids llama.cpp picks greedily (argmax of the logits, each prompt in a fresh context).
// KV_TYPE: f16 (llama.cpp's default cache, the default here) or f32; FLASH: auto (the default),
// on or off -- as pd-logits takes them.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 4 || argc > 6) {
        std::fprintf(stderr, "usage: %s MODEL.gguf N_NEW THREADS [f16|f32 [auto|on|off]] < prompts (token ids, one prompt a line)\n", argv[0]);
        return 2;
    }
    const int n_new = std::atoi(argv[2]);
    const int threads = std::atoi(argv[3]);
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
    std::string line;
    while (std::getline(std::cin, line)) {
        std::vector<llama_token> prompt;
        std::istringstream in(line);
        for (llama_token t; in >> t;) prompt.push_back(t);
        if (prompt.empty()) continue;
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = prompt.size() + n_new + 16;
        cp.n_batch = cp.n_ctx;
        cp.n_ubatch = cp.n_ctx;
        cp.n_threads = cp.n_threads_batch = threads;
        cp.type_k = cp.type_v = kv == "f32" ? GGML_TYPE_F32 : GGML_TYPE_F16;
        cp.flash_attn_type = flash == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED
                           : flash == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
        cp.no_perf = true;
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) { std::fprintf(stderr, "cannot create a context\n"); return 1; }
        llama_batch batch = llama_batch_get_one(prompt.data(), (int32_t) prompt.size());
        llama_token tok = 0;
        for (int i = 0; i < n_new; i++) {
            if (llama_decode(ctx, batch) != 0) { std::fprintf(stderr, "llama_decode failed\n"); return 1; }
            const float * logits = llama_get_logits_ith(ctx, -1);
            tok = 0;
            for (int v = 1; v < n_vocab; v++) if (logits[v] > logits[tok]) tok = v;
            std::printf(i ? " %d" : "%d", tok);
            batch = llama_batch_get_one(&tok, 1);
        }
        std::printf("\n");
        std::fflush(stdout);
        llama_free(ctx);
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
