"""``python benchmarks/traced.py``: how long ``bh.from_torch(model, example_inputs)`` takes to read a
GPT-2-small-sized nanoGPT by tracing (d 768, 12 layers, 12 heads, vocab 50,257, 1024 positions, random
weights, float32 module, ids of shape (1, 16)), one thread (docs/results.md, "Reading a model by tracing").

The nanoGPT is the one of tests/test_traced.py. Each call does all the reader's work: the float64 copy of the
module, ``torch.export``, the reading of the graph, the two float64 forward checks, and the copy of the
parameters into ``params``. The first call in the process pays ``torch.export``'s one-time set-up; the
JSON has every call's seconds, ``torch.export`` alone and a plain ``deepcopy(model).double()`` for the
breakdown, and the machine's load average (the CPU is shared). Writes ``benchmarks/results/traced-<commit>.json``.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import blockhess as bh  # noqa: E402
from test_traced import GPT, GPTConfig  # noqa: E402


def main(repeats: int = 3, threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768, bias=True, flash=True)
    model = GPT(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cfg, params = bh.from_torch(model, ids)
        seconds.append(time.perf_counter() - t0)
    # the two largest parts alone, for the breakdown: the float64 copy, and torch.export of it
    t0 = time.perf_counter()
    m64 = copy.deepcopy(model).double()
    t_copy = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch.export.export(m64, (ids,), strict=False)
    t_export = time.perf_counter() - t0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    out = dict(what="bh.from_torch(nanoGPT, ids) by tracing, GPT-2-small size", commit=commit, torch=torch.__version__,
               threads=threads, cpu=platform.processor() or platform.machine(), inputs=list(ids.shape),
               n_params=sum(p.numel() for p in model.parameters()), n_layers=len(cfg.blocks), tied=cfg.tied,
               seconds=seconds, first=seconds[0], best=min(seconds), target_seconds=10.0,
               export_alone_seconds=t_export, deepcopy_double_seconds=t_copy,
               load_average=os.getloadavg(), cores=os.cpu_count())
    path = os.path.join(HERE, "results", f"traced-{commit}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
