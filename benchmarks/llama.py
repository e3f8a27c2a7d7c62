"""``python benchmarks/llama.py --out FILE``: the Llama-family paths against autograd, in one process
(docs/results.md, "Llama-family blocks and models", issue 27).

1. ``block``: one Hessian-vector product of a Llama-style block (default GPT-2-small width: d = 768, 12
   query heads on 4 K/V heads of width 64, SwiGLU d_ff = 2,048, RoPE, RMSNorm, no biases, causal; B = 8,
   L = 256; MSE at the block output against a random target; float32): our operator's ``A @ v``
   (``bh.hessian_operator``, its setup apart) against double backward through ``bh.reference.forward``
   recomputing the forward and double backward on a graph kept from one ``create_graph=True`` gradient.
   Interleaved rounds after a warm-up, medians, the order rotated each round; each result checked against
   the retained graph's. With ``--memory`` each method's peak resident memory over its setup and first
   product, in a fresh worker process (``--worker``), above the process's once the inputs are built.
2. ``dense``: the dense Hessian of a 2-layer tiny Llama language model (``bh.hessian`` on the mean token
   cross-entropy, tied head off) against ``torch.autograd.functional.hessian(vectorize=True)`` of the same
   loss through ``bh.reference.forward``, float64; medians after a warm-up, relative Frobenius error.

``--threads`` torch threads (default 1). ``os.getloadavg()`` is recorded at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

import blockhess as bh  # noqa: E402
from blockhess import reference  # noqa: E402
import interleaved  # noqa: E402  (benchmarks/, the script's own folder)
from blockhess_lab.runtime import environment, git_commit, load_average  # noqa: E402

BLOCK_METHODS = ("ours", "double_backward", "retained")


def llama_block(d: int, heads: int, kv: int, d_ff: int) -> bh.BlockConfig:
    hd = d // heads
    return bh.BlockConfig(d_model=d, d_ff=d_ff, n_heads=heads, n_kv_heads=kv, d_k=hd, d_v=hd, out_proj=True, norm="pre",
                          norm_type="rms", ln_affine=True, ln_eps=1e-6, gated=True, activation="silu", rope=True,
                          causal=True)


class BlockProblem:
    def __init__(self, args, dtype=torch.float32):
        self.cfg = llama_block(args.d, args.heads, args.kv_heads, args.d_ff)
        gen = torch.Generator().manual_seed(args.seed)
        self.params = {k: (v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype)).to(dtype)
                       for k, v in bh.init_params(self.cfg, seed=args.seed).items()}
        self.X = torch.randn(args.B, args.L, args.d, generator=gen).to(dtype)
        self.T = torch.randn(args.B, args.L, args.d, generator=gen).to(dtype)
        self.names = list(self.params)
        self.leaves = [self.params[n].clone().requires_grad_(True) for n in self.names]
        self.v_list = [torch.randn(self.params[n].shape, generator=gen).to(dtype) for n in self.names]
        self.v = torch.cat([t.reshape(-1) for t in self.v_list])

    def loss(self):
        Z = reference.forward(dict(zip(self.names, self.leaves)), self.X, self.cfg)
        return ((Z - self.T) ** 2).mean()


def block_setup(P: BlockProblem, method: str):
    if method == "ours":
        A = bh.hessian_operator(P.params, P.X, P.cfg, loss="mse", target=P.T)
        return lambda: A @ P.v
    if method == "double_backward":
        def call():
            g = torch.autograd.grad(P.loss(), P.leaves, create_graph=True)
            return torch.autograd.grad(g, P.leaves, grad_outputs=P.v_list)
        return call
    if method == "retained":
        g = torch.autograd.grad(P.loss(), P.leaves, create_graph=True)
        return lambda: torch.autograd.grad(g, P.leaves, grad_outputs=P.v_list, retain_graph=True)
    raise ValueError(method)


def _flat(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else torch.cat([t.reshape(-1) for t in out])


def block_timed(args, log) -> dict:
    P = BlockProblem(args)
    calls = {}
    for m in BLOCK_METHODS:
        t = time.perf_counter()
        calls[m] = block_setup(P, m)
        log(f"setup {m}: {time.perf_counter() - t:.2f} s")
    times, results = interleaved.rounds(calls, args.rounds, args.warmup, log, keep=lambda m, out: _flat(out).double())
    ref = results["retained"]
    med = {m: statistics.median(times[m]) for m in BLOCK_METHODS}
    return {"n_params": int(P.v.numel()), "seconds": times, "median_s": med,
            "rel_error_vs_retained": {m: float((results[m] - ref).norm() / ref.norm()) for m in results},
            "ratio_double_backward_over_ours": med["double_backward"] / med["ours"],
            "ratio_retained_over_ours": med["retained"] / med["ours"]}


def worker(args) -> int:
    torch.set_num_threads(args.threads)
    P = BlockProblem(args)
    print(json.dumps({"method": args.worker, **interleaved.peak_of_first_call(lambda: block_setup(P, args.worker))}))
    return 0


def block_memory(args, log) -> dict:
    keep = ("--d", "--heads", "--kv-heads", "--d-ff", "--B", "--L", "--seed", "--threads")
    flags = [x for k in keep for x in (k, str(getattr(args, k.lstrip("-").replace("-", "_"))))]
    return interleaved.peaks_in_fresh_processes(__file__, BLOCK_METHODS, flags, log)


def dense(args, log) -> dict:
    """The dense Hessian of a 2-layer tiny Llama LM, ours against autograd's, float64."""
    block = llama_block(args.tiny_d, 2, 1, args.tiny_d_ff)
    cfg = bh.ModelConfig(blocks=(block, block), embedding="token", vocab=args.tiny_vocab, final_norm=True,
                         norm_type="rms", norm_bias=False, norm_eps=1e-6, head=args.tiny_vocab, head_bias=False)
    gen = torch.Generator().manual_seed(args.seed)
    params = {k: v + 0.1 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in bh.init_params(cfg).items()}
    ids = torch.randint(0, args.tiny_vocab, (args.tiny_B, args.tiny_L), generator=gen)
    y = torch.randint(0, args.tiny_vocab, (args.tiny_B, args.tiny_L), generator=gen)
    names = list(params)
    sizes = [params[n].numel() for n in names]

    def f(flat):
        p = {n: c.reshape(params[n].shape) for n, c in zip(names, flat.split(sizes))}
        z = reference.forward(p, ids, cfg)
        return torch.nn.functional.cross_entropy(z.reshape(-1, args.tiny_vocab), y.reshape(-1))

    x = torch.cat([params[n].reshape(-1) for n in names])
    calls = {"ours": lambda: bh.hessian(params, ids, cfg, loss="ce", target=y).dense(),
             "autograd": lambda: torch.autograd.functional.hessian(f, x, vectorize=True)}
    times, results = interleaved.rounds(calls, args.rounds, args.warmup, lambda msg: log(f"dense {msg}"))
    med = {m: statistics.median(times[m]) for m in calls}
    err = float((results["ours"] - results["autograd"]).norm() / results["autograd"].norm())
    return {"n_params": int(x.numel()), "B": args.tiny_B, "L": args.tiny_L, "seconds": times, "median_s": med,
            "rel_frobenius_error": err, "ratio_autograd_over_ours": med["autograd"] / med["ours"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--B", type=int, default=8)
    p.add_argument("--L", type=int, default=256)
    p.add_argument("--tiny-d", type=int, default=8)
    p.add_argument("--tiny-d-ff", type=int, default=12)
    p.add_argument("--tiny-vocab", type=int, default=16)
    p.add_argument("--tiny-B", type=int, default=2)
    p.add_argument("--tiny-L", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", default="block,dense", help="comma-separated: block, dense")
    p.add_argument("--memory", action="store_true", help="also each block method's peak memory, in fresh processes")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--worker", choices=BLOCK_METHODS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        return worker(args)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    rep = {"benchmark": "llama", "commit": git_commit(), "environment": environment(), "settings": vars(args),
           "load_average_at_start": load_average()}
    parts = args.parts.split(",")
    if "block" in parts:
        rep["block"] = block_timed(args, log)
        if args.memory:
            rep["block"]["memory"] = block_memory(args, log)
        s = rep["block"]
        log(f"block: ours {s['median_s']['ours']:.3f} s, double backward {s['ratio_double_backward_over_ours']:.2f}x, "
            f"retained {s['ratio_retained_over_ours']:.2f}x, errors {s['rel_error_vs_retained']}")
    if "dense" in parts:
        rep["dense"] = dense(args, log)
        s = rep["dense"]
        log(f"dense: n={s['n_params']}, ours {s['median_s']['ours']:.3f} s, autograd {s['ratio_autograd_over_ours']:.2f}x, "
            f"error {s['rel_frobenius_error']:.2e}")
    rep["load_average_at_end"] = load_average()
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
