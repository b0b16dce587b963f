"""llama.cpp's greedy decoding through llama-cpp-python's bindings of its C API, for the tools beside it
(`pdhost bench model` installs the bindings; put them on PYTHONPATH)."""
import llama_cpp as L
import numpy as np


class Llama:
    """A GGUF file loaded by llama.cpp."""

    def __init__(self, gguf):
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text):
        """The ids of `text`, with the model's BOS where it adds one."""
        b = text.encode()
        buf = (L.llama_token * (len(b) + 16))()
        n = L.llama_tokenize(self.vocab, b, len(b), buf, len(buf), True, False)
        return list(buf[:n])

    def greedy(self, ids, n):
        """`n` greedy tokens after the prompt `ids` (past an end of text too), and each step's margin: its
        top logit minus the runner-up."""
        params = L.llama_context_default_params()
        params.n_ctx = len(ids) + n + 8
        params.n_batch = max(512, len(ids))
        ctx = L.llama_init_from_model(self.model, params)
        batch = L.llama_batch_init(len(ids), 0, 1)
        out, margins, pos, toks = [], [], 0, list(ids)
        for _ in range(n):
            batch.n_tokens = len(toks)
            for i, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, pos + i, 1, i == len(toks) - 1
                batch.seq_id[i][0] = 0
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
            pos += len(toks)
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(toks) - 1), shape=(self.n_vocab,))
            top2 = np.partition(logits, -2)[-2:]
            out.append(int(logits.argmax()))
            margins.append(float(top2.max() - top2.min()))
            toks = [out[-1]]
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        return out, margins
