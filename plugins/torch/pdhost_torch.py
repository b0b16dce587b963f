"""pdhost's `torch` backend: prefill with PyTorch and Hugging Face transformers, on another numerical stack
than the host's, emitting grouped K/V spans from the transformers cache.

`pdhost generate --producer torch` runs this class in a producer (docs/plugin-abi.md, "Python backends";
docs/torch-backend.md). It loads the host's model itself: a checkpoint directory as it is, a GGUF file
dequantized by transformers. transformers reads a GGUF's metadata slowly (tens of seconds for Gemma 3's
262144-token vocabulary, each time), so the dequantized checkpoint is saved once as safetensors under
`cache_dir`, keyed by the GGUF's weight digest, and loaded from there afterwards.

Configuration keys beyond the host's (all optional):

| key | type | what |
|---|---|---|
| `torch_dtype` | string | `float32` (default) or `bfloat16`: the arithmetic of the forward pass |
| `device` | string | a torch device; default `cuda` when a GPU is present, else `cpu` |
| `cache_dir` | string | where dequantized GGUF checkpoints are kept (the host sets it) |
| `torch_model` | string | load this model instead of `model` (a test of the identity check) |

Every K/V entry is written straight into the ring slot: `torch.frombuffer` views the region, `copy_` converts
to the wire dtype (the host cache's `dtype`) and, on a GPU, copies from the device.

Sliding-window layers: transformers' default cache keeps only the last `sliding_window - 1` positions of a
sliding layer. This backend passes `DynamicCache()` without a config, which keeps every position of every
layer, so each span carries full-length K/V for every layer; the attention mask still applies the window,
so the logits are those of the default cache. The host keeps what its window needs.
"""

import json
import os
import struct

# Requests whose cache is kept for a following chunk; the oldest is dropped past this many.
LIVE_REQUESTS = 16

_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _f32_text(x):
    """The shortest decimal that reads back as the same f32, as the host writes rope bases (`1000000`, `0.5`)."""
    import numpy

    return numpy.format_float_positional(numpy.float32(x), unique=True, trim="-")


def _digest_files(paths):
    import xxhash

    h = xxhash.xxh3_64(seed=0)
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.intdigest()


class _Gguf:
    """The parts of a GGUF file the identity needs: the token strings and the span of tensor data."""

    _SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def __init__(self, path):
        from gguf.constants import GGML_QUANT_SIZES

        with open(path, "rb") as f:
            data = f.read(64 << 20)
        self.buf, self.at = memoryview(data), 0
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: expected a GGUF file of version 2 or later, found magic {magic!r} v{version}")
        self.at = 24
        self.tokens, alignment = [], 32
        for _ in range(n_kv):
            key = self._str()
            kind = self._u(4)
            if key == "tokenizer.ggml.tokens" and kind == 9:
                item, count = self._u(4), self._u(8)
                self.tokens = [self._str() for _ in range(count)] if item == 8 else []
            elif key == "general.alignment" and kind == 4:
                alignment = self._u(4)
            else:
                self._skip(kind)
        spans = []
        for _ in range(n_tensors):
            self._str()
            dims = [self._u(8) for _ in range(self._u(4))]
            ggml_type, offset = self._u(4), self._u(8)
            block, block_bytes = GGML_QUANT_SIZES[ggml_type]
            elems = 1
            for d in dims:
                elems *= d
            spans.append((offset, offset + elems // block * block_bytes))
        data_start = -(-self.at // alignment) * alignment
        self.start = data_start + min(s for s, _ in spans)
        self.end = data_start + max(e for _, e in spans)
        del self.buf

    def _u(self, n):
        (v,) = struct.unpack_from("<I" if n == 4 else "<Q", self.buf, self.at)
        self.at += n
        return v

    def _str(self):
        n = self._u(8)
        s = bytes(self.buf[self.at : self.at + n]).decode("utf-8", "replace")
        self.at += n
        return s

    def _skip(self, kind):
        if kind == 8:
            n = self._u(8)  # read first: `self.at += self._u(8)` would add to the position before the read
            self.at += n
        elif kind == 9:
            item, count = self._u(4), self._u(8)
            if item in self._SCALARS:
                self.at += count * struct.calcsize("<" + self._SCALARS[item])
            else:
                for _ in range(count):
                    self._skip(item)
        else:
            self.at += struct.calcsize("<" + self._SCALARS[kind])

    def weights_digest(self, path):
        import xxhash

        h = xxhash.xxh3_64(seed=0)
        with open(path, "rb") as f:
            f.seek(self.start)
            left = self.end - self.start
            while left > 0:
                chunk = f.read(min(left, 1 << 22))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
        return h.intdigest()

    def tokenizer_digest(self):
        import xxhash

        return xxhash.xxh3_64_intdigest("\n".join(self.tokens).encode("utf-8"), seed=0)


class _one_reader_per_file:
    """Within the block, `gguf.GGUFReader` parses each file once: transformers opens a GGUF for its config and
    again for its weights, and each parse of Gemma 3's metadata takes 15 s."""

    def __enter__(self):
        import gguf

        self.module, self.original, readers = gguf, gguf.GGUFReader, {}

        def reader(path, *args, **kwargs):
            key = (os.path.abspath(path), args, tuple(sorted(kwargs.items())))
            if key not in readers:
                readers[key] = self.original(path, *args, **kwargs)
            return readers[key]

        gguf.GGUFReader = reader

    def __exit__(self, *exc):
        self.module.GGUFReader = self.original


class TorchBackend:
    """The backend contract (open, describe, prefill, release) on transformers."""

    def open(self, config):
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF loader draws bars on stderr
        import numpy  # noqa: F401  (imported while the file system is open: the sandbox refuses it later)
        import torch
        import transformers
        import xxhash  # noqa: F401

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        self.torch = torch
        self.cache_class = transformers.DynamicCache
        path = str(config.get("torch_model") or config["model"])
        compute = config.get("torch_dtype", "float32")
        if compute not in _TYPES:
            raise ValueError(f"torch_dtype: expected float32, bfloat16 or float16, found {compute!r}")
        self.compute = getattr(torch, compute)
        wire = config.get("dtype") or _TYPES[compute]
        wire_types = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
        if wire not in wire_types:
            raise ValueError(f"dtype: expected f32, bf16 or f16, found {wire!r}")
        self.wire, self.wire_name = wire_types[wire], wire
        # transformers' K rotates halves of each head (dims i and i + d/2); a host whose rope rotates adjacent
        # pairs (a GGUF Llama: llama.cpp's converter permuted the Q/K rows) holds K with those dims at 2i
        # and 2i + 1. Same attention scores, other bytes: K is sent in the host's order.
        pairs = config.get("rope_pairs", "halves")
        if pairs not in ("halves", "adjacent"):
            raise ValueError(f"rope_pairs: expected halves or adjacent, found {pairs!r}")
        self.adjacent = pairs == "adjacent"
        self.device = torch.device(config.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        if config.get("threads"):
            torch.set_num_threads(int(config["threads"]))

        if path.endswith(".gguf"):
            checkpoint, weights, tokenizer = self._from_gguf(path, config.get("cache_dir"))
        else:
            names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            weights = _digest_files([os.path.join(path, n) for n in names])
            tok = os.path.join(path, "tokenizer.json")
            tokenizer = _digest_files([tok]) if os.path.isfile(tok) else 0
            checkpoint = path
        self.model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=self.compute)
        self.model.to(self.device).eval()
        cfg = self.model.config
        self.layers = self._layers(cfg)
        glob, local = self._rope(cfg)
        self.identity = f"weights:{weights:016x};tokenizer:{tokenizer:016x};rope:{_f32_text(glob)}/{_f32_text(local)}"
        # Grouped entry order: groups ordered by their first layer (full layers one group, sliding layers one
        # group per window), layers in model order inside a group, K then V.
        groups = {}
        for i, layer in enumerate(self.layers):
            groups.setdefault((layer["kind"], layer["window"]), []).append(i)
        self.entries = [(i, kv) for members in groups.values() for i in members for kv in (0, 1)]
        self.requests = {}
        # One forward pass now, so that everything torch loads lazily is loaded before the sandbox closes
        # the file system.
        self._forward([0], self.cache_class())

    def _from_gguf(self, path, cache_dir):
        gguf = _Gguf(path)
        weights = gguf.weights_digest(path)
        tokenizer = gguf.tokenizer_digest()
        if not cache_dir:
            raise ValueError("cache_dir: expected a directory for dequantized GGUF checkpoints, found none")
        target = os.path.join(cache_dir, f"{weights:016x}")
        if not os.path.isfile(os.path.join(target, "config.json")):
            import fcntl

            os.makedirs(cache_dir, exist_ok=True)
            # One producer converts; one started beside it (a second --producers, a parallel test) waits.
            with open(f"{target}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not os.path.isfile(os.path.join(target, "config.json")):
                    self._convert(path, weights, target)
        return target, weights, tokenizer

    def _convert(self, path, weights, target):
        """Dequantizes the GGUF at `path` with transformers and saves it as f32 safetensors in `target`."""
        import shutil

        import transformers

        scratch = f"{target}.{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        with _one_reader_per_file():
            model = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path), dtype=self.torch.float32
            )
        # The loaded model is plain f32 tensors, but it still says it was "quantized with gguf", and
        # transformers refuses to save such a model: forget that it was.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch)
        with open(os.path.join(scratch, "pdhost-source.json"), "w") as f:
            json.dump({"gguf": os.path.abspath(path), "weights": f"{weights:016x}"}, f)
        os.rename(scratch, target)

    @staticmethod
    def _layers(cfg):
        n = cfg.num_hidden_layers
        kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * n
        kv_heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        window = getattr(cfg, "sliding_window", None) or 0
        layers = []
        for kind in kinds:
            if kind == "sliding_attention":
                layers.append({"kind": "sliding", "kv_heads": kv_heads, "head_dim": head_dim, "window": window})
            elif kind == "full_attention":
                layers.append({"kind": "full", "kv_heads": kv_heads, "head_dim": head_dim, "window": 0})
            else:
                raise ValueError(f"layer type: expected full_attention or sliding_attention, found {kind!r}")
        return layers

    @staticmethod
    def _rope(cfg):
        """The global and the sliding layers' rope bases the model computes with."""
        params = getattr(cfg, "rope_parameters", None) or {}
        if "full_attention" in params:
            glob = params["full_attention"]["rope_theta"]
            local = params.get("sliding_attention", params["full_attention"])["rope_theta"]
        else:
            glob = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
            local = glob
        return glob, local

    def describe(self):
        return {"layout": "grouped", "dtype": self.wire_name, "layers": self.layers, "identity": self.identity}

    # A prefix-cache hit comes as a request starting past 0 with the tokens before it as `context`.
    takes_context = True

    def prefill(self, request, tokens, start, writer, context=None):
        torch = self.torch
        if start == 0:
            cache = self.cache_class()
        elif context is not None:
            # The host holds the prefix's K/V already; this backend recomputes it to attend to it.
            if len(context) != start:
                raise ValueError(f"request {request}: expected {start} context tokens, found {len(context)}")
            cache = self.cache_class()
            self._forward(context, cache)
        else:
            if request not in self.requests:
                raise ValueError(f"request {request}: a chunk at position {start}, but no earlier chunk is kept")
            cache, at = self.requests.pop(request)
            if at != start:
                raise ValueError(f"request {request}: expected the chunk at position {at}, found {start}")
        n = len(tokens)
        self._forward(tokens, cache)
        with torch.inference_mode():
            for entry, (layer, kv) in enumerate(self.entries):
                held = cache.layers[layer]
                src = (held.keys if kv == 0 else held.values)[0, :, start : start + n, :].transpose(0, 1)
                if kv == 0 and self.adjacent:  # [n, heads, 2, d/2] -> [n, heads, d/2, 2]: dim i to 2i, i + d/2 to 2i + 1
                    rows, heads, dim = src.shape
                    src = src.reshape(rows, heads, 2, dim // 2).transpose(-1, -2).reshape(rows, heads, dim)
                dst = torch.frombuffer(writer.region(entry), dtype=self.wire).view(src.shape)
                dst.copy_(src)
                del dst
        self.requests[request] = (cache, start + n)
        while len(self.requests) > LIVE_REQUESTS:
            self.requests.pop(next(iter(self.requests)))

    def _forward(self, tokens, cache):
        """Runs `tokens` through the model after what `cache` holds, appending their K/V to it (the logits of
        the last token only: the host computes its own)."""
        with self.torch.inference_mode():
            ids = self.torch.tensor([tokens], dtype=self.torch.long, device=self.device)
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

    def release(self, request):
        self.requests.pop(request, None)
