"""The memory estimates behind the library's guards against measured peaks (docs/results.md, "Memory").

``python benchmarks/memory_estimates.py [--out FILE.json]`` runs each case in a fresh process
(one thread) and prints, per case, the bytes the library's check asked for (the estimate it
refuses by, result included) beside the peak resident memory the call added, and their ratio.
The peak is ``ru_maxrss`` after the call less the resident memory before it, after a warm-up
call at a tiny size (lazy imports, torch.func's set-up). glibc's mmap threshold is fixed at
64 KiB (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the process at once and the peak is
what the call held, not what the allocator kept from earlier calls (with the default dynamic
threshold the same calls measure up to 1.6x more on repeated work). A ratio below 1: the
estimate is above the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

CASES = [  # (function, options); B = 0: one sequence (L, d)
    ("hessian", dict(d_model=16, d_ff=32, B=0, L=256)),
    ("hessian", dict(d_model=16, d_ff=32, B=0, L=128)),
    ("hessian", dict(d_model=32, d_ff=64, B=0, L=32)),
    ("hessian", dict(d_model=64, d_ff=256, B=0, L=256, bias=True, wrt=["b_1"])),
    ("hessian", dict(d_model=64, d_ff=256, B=0, L=256, bias=True, wrt=["b_1"], activation="gelu")),
    ("hessian", dict(d_model=128, d_ff=128, B=0, L=64, n_heads=4, bias=True, wrt=["b_Q"])),
    ("hessian", dict(d_model=64, d_ff=128, B=0, L=128, n_heads=4, out_proj=True, bias=True, wrt=["b_O"])),
    ("hessian", dict(d_model=32, d_ff=64, B=0, L=64, norm="pre", ln_affine=True, wrt=["gamma_1"])),
    ("hessian", dict(d_model=64, d_ff=256, B=0, L=64, norm="pre", bias=True, ln_affine=True, wrt=["b_1"],
                     activation="gelu")),
    ("hessian", dict(d_model=16, d_ff=32, B=0, L=64, wrt_input=True)),
    ("hessian", dict(d_model=8, d_ff=16, B=0, L=128, wrt_input=True, norm="pre")),
    ("hessian", dict(d_model=32, d_ff=64, B=2, L=32, wrt_input=True)),
    ("hessian", dict(d_model=16, d_ff=32, B=128, L=16, loss="head", classes=10)),
    ("jacobian", dict(d_model=64, d_ff=256, B=4, L=64)),
    ("jacobian", dict(d_model=64, d_ff=128, B=2, L=64, n_heads=4, wrt=["W_K"])),
    ("input_jacobian", dict(d_model=32, d_ff=64, B=4, L=32)),
    ("second_derivative", dict(d_model=16, d_ff=32, B=0, L=32, a="W_Q", b="W_K")),
    ("second_derivative", dict(d_model=16, d_ff=32, B=0, L=64, a="W_1", b="W_1")),
    ("loss", dict(d_model=16, B=1, L=16, loss="head", classes=4096)),
    ("loss", dict(d_model=32, B=1, L=32, loss="head", classes=4096)),
    ("loss", dict(d_model=16, B=4, L=16, loss="head", classes=4096)),
    ("loss", dict(d_model=32, B=1, L=32, loss="head", classes=10)),
    ("loss", dict(d_model=16, B=1, L=16, loss="mlp", classes=1000, hidden=512)),
    ("loss", dict(d_model=32, B=1, L=32, loss="poly")),
    ("loss", dict(d_model=16, B=8, L=64, loss="head", classes=10)),
    ("reference", dict(d_model=32, d_ff=64, B=1, L=32, wrt=["W_Q", "W_K", "W_V"])),
    ("reference", dict(d_model=32, d_ff=64, B=1, L=16)),
    ("reference", dict(d_model=16, d_ff=32, B=1, L=64)),
    ("reference", dict(d_model=16, d_ff=32, B=4, L=16)),
    ("reference", dict(d_model=8, d_ff=16, B=8, L=32)),
    ("reference", dict(d_model=16, d_ff=64, B=2, L=16, n_heads=4, bias=True, out_proj=True, ln_affine=True, norm="pre",
                       activation="gelu")),
    ("reference", dict(d_model=16, d_ff=32, B=16, L=16, loss="head", classes=10)),
    ("reference", dict(d_model=16, d_ff=32, B=4, L=16, loss="head", classes=4096)),
]
CFG_KEYS = ("d_model", "d_ff", "n_heads", "norm", "bias", "out_proj", "ln_affine", "activation")


def _loss(spec, d):
    """The case's loss: "mse" or a callable on one sequence (a classifier head, an MLP head, a polynomial)."""
    import torch

    g = torch.Generator().manual_seed(1)
    kind = spec.get("loss", "mse")
    if kind == "head":
        W = torch.randn(d, spec["classes"], dtype=torch.float64, generator=g) / d**0.5
        return lambda Z, y: torch.nn.functional.cross_entropy((Z.mean(0) @ W)[None], y[None])
    if kind == "mlp":
        W1 = torch.randn(d, spec["hidden"], dtype=torch.float64, generator=g) / d**0.5
        W2 = torch.randn(spec["hidden"], spec["classes"], dtype=torch.float64, generator=g) / spec["hidden"] ** 0.5
        return lambda Z, y: torch.nn.functional.cross_entropy((torch.tanh(Z @ W1).mean(0) @ W2)[None], y[None])
    if kind == "poly":
        return lambda Z, y: ((Z - 1) ** 4).mean() + (Z.sum(1) ** 2).mean()
    return "mse"


def child(fn: str, spec: dict) -> dict:
    import importlib

    import psutil
    import torch

    import blockhess as bh
    from blockhess import losses, reference

    cfg_kw = {k: spec[k] for k in CFG_KEYS if k in spec}
    cfg = bh.BlockConfig(ln_eps=1e-5, **cfg_kw)
    B, L, d = spec["B"], spec["L"], cfg.d_model
    g = torch.Generator().manual_seed(0)

    def make(cfg, B, L):
        p = bh.init_params(cfg)
        X = torch.randn(*((B,) if B else ()), L, cfg.d_model, dtype=torch.float64, generator=g)
        kind = spec.get("loss", "mse")
        target = (torch.randn(X.shape, dtype=torch.float64, generator=g) if kind == "mse" else
                  torch.randint(0, spec.get("classes", 2), (max(B, 1),), generator=g) if kind in ("head", "mlp") else None)
        return p, X, target

    def call(cfg, p, X, target, loss):
        if fn == "hessian":
            return bh.hessian(p, X, cfg, loss=loss, target=target, wrt=spec.get("wrt"), wrt_input=spec.get("wrt_input", False))
        if fn == "reference":
            return reference.hessian(p, X, cfg, loss=loss, target=target, wrt=spec.get("wrt"))
        if fn == "jacobian":
            return bh.jacobian(p, X, cfg, wrt=spec.get("wrt"))
        if fn == "input_jacobian":
            return bh.input_jacobian(p, X, cfg)
        if fn == "second_derivative":
            return bh.second_derivative(p, X, cfg, spec["a"], spec["b"])
        if fn == "loss":
            return losses.derivatives(loss, target, X if X.ndim == 3 else X[None])
        raise ValueError(fn)

    tiny = bh.BlockConfig(**{**cfg_kw, "d_model": 2 * cfg.n_heads, "d_ff": 4})  # the warm-up
    if fn == "loss":
        torch.func.vmap(torch.func.hessian(lambda z: (z**3).sum()))(torch.randn(2, 3, 4, dtype=torch.float64))
    else:
        p0, X0, t0 = make(tiny, 1 if B else 0, 2)
        if spec.get("loss", "mse") == "mse":
            call(tiny, p0, X0, t0, "mse")
        else:
            call(tiny, p0, X0, torch.zeros(1, dtype=torch.long), _loss(dict(spec, classes=3), tiny.d_model))
    p, X, target = make(cfg, B, L)
    loss = _loss(spec, d)
    asked = []
    for name in ("reference", "block", "hessian", "blocks", "losses"):  # record what each check is asked for
        mod = importlib.import_module(f"blockhess.{name}")
        mod.check_fits = (lambda orig: lambda n, what, dev: (asked.append((n, what)), orig(n, what, dev)))(mod.check_fits)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss = psutil.Process().memory_info().rss
    start = time.perf_counter()
    call(cfg, p, X, target, loss)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    estimate, what = max(asked) if asked else (0, "")
    peak = after - rss if after > before else None
    return {"fn": fn, "case": spec, "estimate": estimate, "check": what, "peak": peak, "seconds": seconds,
            "ratio": None if peak is None or not estimate else peak / estimate}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--default-malloc", action="store_true", help="leave glibc's mmap threshold dynamic (its default)")
    args = ap.parse_args(argv)
    if args.child:
        fn, spec = json.loads(args.child)
        print(json.dumps(child(fn, spec)))
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if not args.default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["PYTHONPATH"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
    rows = []
    print(f"{'function':<18} {'case':<96} {'estimate MiB':>12} {'peak MiB':>9} {'peak/est':>8}")
    for fn, spec in CASES:
        run = subprocess.run([sys.executable, __file__, "--child", json.dumps([fn, spec])], env=env, capture_output=True,
                             text=True, timeout=600)
        row = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else {"fn": fn, "case": spec,
                                                                                         "error": run.stderr[-300:]}
        rows.append(row)
        case = ", ".join(f"{k}={v}" for k, v in spec.items())
        if "error" in row:
            print(f"{fn:<18} {case:<96} error: {row['error'].splitlines()[-1]}")
        else:
            ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
            print(f"{fn:<18} {case:<96} {row['estimate'] / 2**20:>12.1f} {(row['peak'] or 0) / 2**20:>9.1f} {ratio:>8}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
