"""A long run of the traced reader's fuzzer (docs/results.md, "Reading a model by tracing"; issue 28).

``tests/test_traced.py``'s fuzzer composes a model of its supported parts (an embedding, optional learned
positions, one or two blocks of a norm in one of four written forms, pre- or post-LN, fused or separate
projections, SDPA or a hand-written softmax with a ``masked_fill`` or an additive causal mask, a plain or
gated FFN with one of four activations, a linear head), optionally with one unsupported part (a LayerScale,
``tanh``, a wrong attention scale, a custom ``torch.autograd.Function``, a ``detach``). The suite runs a few
seeds; this runs ``--seeds`` seeds (default 60) of each of the six variants. Each outcome must be one of:

* no unsupported part: read, ``bh.forward`` equal to the module's forward to 1e-12 relative (float64) on
  the example input and on a second random input, the blocks counted right;
* an unsupported part: refused with a ``ValueError`` naming it (the pattern of ``UNSUPPORTED``).

Anything else (a supported model refused, an unsupported one read, another error, a forward that differs)
is a failure, listed in the JSON (``benchmarks/results/fuzz-traced-<commit>.json``).
Run: ``PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/fuzz_traced.py [--seeds 60]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import blockhess as bh  # noqa: E402
from blockhess_lab.runtime import environment, git_commit, load_average  # noqa: E402
from test_traced import UNSUPPORTED, FuzzModel, ids, randomise  # noqa: E402

TOL = 1e-12


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(b.dtype).tiny))


def one(seed: int, bad: str | None) -> dict:
    rng = random.Random(seed)
    model = randomise(FuzzModel(rng, bad), seed=seed)
    x = ids(7, seed=seed)
    rec = {"seed": seed, "bad": bad, "blocks": len(model.blocks)}
    try:
        cfg, p = bh.from_torch(model, x)
    except ValueError as exc:
        rec["outcome"] = "refused"
        rec["message"] = str(exc).splitlines()[0][:300]
        rec["ok"] = bad is not None and re.search(UNSUPPORTED[bad], str(exc)) is not None
        return rec
    except Exception as exc:  # noqa: BLE001 - any other error is a finding, recorded
        return {**rec, "outcome": "error", "ok": False, "message": f"{type(exc).__name__}: {exc}"[:300]}
    x2 = ids(7, seed=seed + 10_000)
    with torch.no_grad():
        errs = [rel(bh.forward(p, v, cfg), model(v)) for v in (x, x2)]
    rec.update(outcome="read", forward_rel_err=max(errs),
               ok=bad is None and max(errs) <= TOL and len(cfg.blocks) == len(model.blocks))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--out", default=None, help="default benchmarks/results/fuzz-traced-<commit>.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    load0 = load_average()
    records = []
    for bad in [None, *UNSUPPORTED]:
        for seed in range(args.seeds):
            records.append(one(1000 + seed, bad))
        print(f"[{time.perf_counter() - t0:6.1f}s] {bad or 'supported'}: "
              f"{sum(r['ok'] for r in records if r['bad'] == bad)}/{args.seeds} as expected", flush=True)
    failures = [r for r in records if not r["ok"]]
    commit = git_commit()
    rep = {"benchmark": "fuzz_traced", "commit": commit, "environment": environment(), "settings": vars(args),
           "load_average_at_start": load0, "load_average_at_end": load_average(),
           "seconds": time.perf_counter() - t0, "configs": len(records),
           "outcomes": {str(k): dict(Counter(r["outcome"] for r in records if r["bad"] == k))
                        for k in [None, *UNSUPPORTED]},
           "max_forward_rel_err": max((r.get("forward_rel_err", 0.0) for r in records), default=0.0),
           "failures": failures}
    out = args.out or os.path.join(HERE, "results", f"fuzz-traced-{commit}.json")
    with open(out, "w") as f:
        json.dump(rep, f, indent=1)
    print(f"{len(records)} configurations, {len(failures)} failures; wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
