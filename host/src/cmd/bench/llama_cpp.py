# Times llama.cpp (through llama-cpp-python) on a GGUF file: prefill of the given prompt ids and greedy
# decode of N tokens, with the given thread count. Prints one JSON object. Run by `pdhost bench model`.
import json, sys, time
from llama_cpp import Llama

path, threads, n_decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ids = [int(x) for x in sys.argv[4].split(",")]
llm = Llama(model_path=path, n_ctx=len(ids) + n_decode + 8, n_batch=512, n_threads=threads,
            n_threads_batch=threads, logits_all=False, verbose=False)
llm.eval(ids[:8])  # warm-up
llm.reset()
t = time.perf_counter()
llm.eval(ids)
prefill = time.perf_counter() - t
t = time.perf_counter()
for _ in range(n_decode):
    scores = llm.scores[llm.n_tokens - 1]
    llm.eval([int(scores.argmax())])
decode = time.perf_counter() - t
print(json.dumps({"prefill_tok_s": len(ids) / prefill, "decode_tok_s": n_decode / decode}))
