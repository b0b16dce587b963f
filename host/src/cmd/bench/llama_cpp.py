# Times llama.cpp (through llama-cpp-python's bindings of its C API) on a GGUF file: prefill of the given
# prompt ids, then greedy decode of N tokens by each of B sequences at once (one llama_decode call per step
# for all of them), for every B given, with the given thread count, after a warm-up prefill. Prints one JSON
# object. Run by `pdhost bench model`, once per repeat, between its own runs.
import json, sys, time

import llama_cpp as L
import numpy as np

path, threads, n_decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
batches = [int(b) for b in sys.argv[4].split(",")]
ids = [int(x) for x in sys.argv[5].split(",")]
most = max(batches)

L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_ctx = most * (len(ids) + n_decode + 9)
params.n_batch = max(512, len(ids), most)
params.n_seq_max = most
params.n_threads = threads
params.n_threads_batch = threads
ctx = L.llama_init_from_model(model, params)
memory = L.llama_get_memory(ctx)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(max(len(ids), most), 0, most)


def decode(items):
    """One llama_decode over (token, position, sequence, wants logits) items."""
    batch.n_tokens = len(items)
    for i, (tok, pos, seq, logits) in enumerate(items):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
        batch.seq_id[i][0] = seq
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")


def argmax(i):
    return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())


def prefill(seq):
    decode([(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)])


def timed_prefill():
    L.llama_memory_clear(memory, True)
    t = time.perf_counter()
    prefill(0)
    return len(ids) / (time.perf_counter() - t)


def timed_decode(b):
    """Aggregate tokens/s of b sequences decoding n_decode tokens each after their prefills."""
    L.llama_memory_clear(memory, True)
    for s in range(b):
        prefill(s)
    nxt = [first] * b
    # The first step of a batch size is not timed (llama.cpp builds its graph for the shape then).
    for step in range(n_decode + 1):
        if step == 1:
            t = time.perf_counter()
        decode([(nxt[s], len(ids) + step, s, True) for s in range(b)])
        nxt = [argmax(s) for s in range(b)]
    return b * n_decode / (time.perf_counter() - t)


prefill(0)  # warm-up
first = argmax(-1)
prefill_tok_s = timed_prefill()
decode_tok_s = {str(b): timed_decode(b) for b in batches}
print(json.dumps({"prefill_tok_s": prefill_tok_s, "decode_tok_s": decode_tok_s}))
