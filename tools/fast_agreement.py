#!/usr/bin/env python3
"""Greedy agreement with `exact` over many prompts: `pdhost generate --precision fast` beside llama.cpp.

usage: PYTHONPATH=$PDHOST_HOME/llama-cpp-python-noamx tools/fast_agreement.py PDHOST GGUF [PROMPTS [TOKENS [SEED]]]

The four reference cases of `shared/reference/` decide `fast`'s agreement with transformers on a handful
of near-ties; this asks the same question of many prompts. `exact` equals transformers' fp32 references
(`refcheck.py`), so it stands in for them here. Prompts (default 48) are runs of 40 to 200 words cut at
random (seeded) from the license texts of /usr/share/common-licenses, where there are any, and this
repository's docs/*.md and fixtures/prompts/*.txt. For each, `exact` decodes TOKENS (default 32) greedily
with each step's two likeliest log-probabilities; `fast`, and llama.cpp (llama-cpp-python's bindings of its
C API, which `pdhost bench model` installs) on the same GGUF, decode the same prompt ids greedily. Each is
compared with `exact` up to `exact`'s first step whose margin is under 0.01, where either answer is right.
Prints, for both, the cases that agree throughout and the comparable tokens that agree."""
import glob, json, os, random, subprocess, sys

from llama_greedy import Llama

pdhost, gguf = sys.argv[1:3]
prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 48
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 32
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 11
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

files = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob(f"{root}/docs/*.md"))
files += sorted(glob.glob(f"{root}/fixtures/prompts/*.txt"))
texts = [open(f, errors="ignore").read().split() for f in files if os.path.isfile(f)]
texts = [t for t in texts if len(t) >= 200]
rng = random.Random(seed)
llama = Llama(gguf)


def generate(ids, precision, logprobs):
    cmd = [pdhost, "generate", "--model", gguf, "--prompt-ids", ",".join(map(str, ids)), "--max-tokens",
           str(tokens), "--producer", "local", "--json", "--precision", precision]
    if logprobs:
        cmd += ["--logprobs", "2"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


# Per side: cases agreeing throughout, comparable tokens agreeing, comparable tokens.
stats = {"fast": [0, 0, 0], "llama.cpp": [0, 0, 0]}
for _ in range(prompts):
    words = rng.choice(texts)
    n = rng.randint(40, 200)
    at = rng.randint(0, len(words) - n)
    ids = llama.tokenize(" ".join(words[at:at + n]))
    exact = generate(ids, "exact", True)
    want = exact["output_ids"]
    margins = [s["top"][0][1] - s["top"][1][1] if len(s["top"]) > 1 else float("inf") for s in exact["logprobs"]]
    k = next((j for j, m in enumerate(margins) if m < 0.01), len(want))
    for name, got in [("fast", generate(ids, "fast", False)["output_ids"]), ("llama.cpp", llama.greedy(ids, len(want))[0])]:
        kk = min(k, len(got))
        same = next((j for j in range(kk) if got[j] != want[j]), kk)
        s = stats[name]
        s[0] += same == kk
        s[1] += same
        s[2] += kk
for name, (cases, matched, compared) in stats.items():
    print(f"{name}: {cases}/{prompts} cases agree with exact, {matched}/{compared} comparable tokens")
