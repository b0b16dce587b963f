#!/usr/bin/env python3
"""Greedy agreement of `pdhost generate` with llama.cpp on the same GGUF file.

usage: PYTHONPATH=$PDHOST_HOME/llama-cpp-python-noamx tools/llama_agreement.py PDHOST GGUF REF_JSON [PDHOST ARGS...]

For every case of a reference file (`shared/reference/greedy_*.json`: prompt ids and an output length),
llama.cpp (llama-cpp-python's bindings of its C API, `pdhost bench model` installs them) decodes greedily
and records each step's margin (top logit minus the runner-up); `pdhost generate --prompt-ids ...` runs
with the extra arguments (e.g. `--precision fast`). The ids are compared up to llama.cpp's first step with
a margin under 0.01, where either answer is right. Prints one line per differing case, then a summary."""
import json, subprocess, sys

from llama_greedy import Llama

pdhost, gguf, ref = sys.argv[1:4]
extra = sys.argv[4:]
cases = json.load(open(ref))["cases"]
llama = Llama(gguf)


agree, compared, matched = 0, 0, 0
for c in cases:
    n = len(c["output_ids"])
    want, margins = llama.greedy(c["prompt_ids"], n)
    cmd = [pdhost, "generate", "--model", gguf, "--prompt-ids", ",".join(map(str, c["prompt_ids"])),
           "--max-tokens", str(n), "--producer", "local", "--json", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    got = json.loads(p.stdout.strip().splitlines()[-1])["output_ids"]
    # pdhost stops at end of text; llama.cpp is not asked to.
    k = min(next((i for i, m in enumerate(margins) if m < 0.01), n), len(got))
    same = next((i for i in range(k) if got[i] != want[i]), k)
    compared += k
    matched += same
    if same == k:
        agree += 1
    else:
        print(f"{c['name']}: differs at step {same} of {k} comparable")
print(f"{len(cases)} cases: {agree}/{len(cases)} agree with llama.cpp, {matched}/{compared} comparable tokens")
