"""``python benchmarks/model_products.py --out FILE``: one Hessian-vector product of a whole Hugging Face
``GPT2LMHeadModel`` (GPT-2-small-sized by default: 12 layers, d = 768, 12 heads, vocabulary 50,257, tied
head, random weights), the mean token cross-entropy on random labels, float32: our operator's ``A @ v``
(``bh.hessian_operator`` on ``bh.from_torch(model)``) against double backward recomputing the forward and
double backward on a graph kept from one ``create_graph=True`` gradient, and the gradient alone, in one
process (docs/results.md, "A whole model's product", issue 29).

For each ``(B, L)`` of ``--shapes``: the methods timed in interleaved rounds after a warm-up (medians,
the order rotated each round; ``ours_out``: our product by ``A.matvec(v, out=y)`` into one output kept
across the rounds), each result checked against the retained graph's (relative Euclidean
error in the model's layout); with ``--base COMMIT`` also our product by the package at ``COMMIT``
(method ``ours_base``, a ``git archive`` imported beside this checkout's); then, with ``--memory``, each method in a fresh worker process
(``--worker``): the kernel's peak resident memory over its setup and first product, above the process's
once the model, the inputs and the vector are built. Baselines run on the module itself (``sdpa`` under
the math kernel: the CPU flash kernel has no second derivative). ``--threads`` torch threads (default 1).
"""

from __future__ import annotations

import argparse
import copy
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
import interleaved  # noqa: E402  (benchmarks/, the script's own folder)
from blockhess_lab.runtime import environment, git_commit, load_average  # noqa: E402

METHODS = ("gradient", "ours", "ours_out", "double_backward", "retained")
BASE = None  # with --base COMMIT: the package at COMMIT, imported as blockhess_base (method ours_base)


class Problem:
    """The model, its parameters read by ``from_torch``, token ids, labels and one direction in both layouts."""

    def __init__(self, B: int, L: int, vocab: int, layers: int, d: int, heads: int, seed: int = 0):
        from transformers import GPT2Config, GPT2LMHeadModel

        conf = GPT2Config(vocab_size=vocab, n_positions=max(L, 1024), n_embd=d, n_layer=layers, n_head=heads,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        conf._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        self.model = GPT2LMHeadModel(conf).eval()
        self.cfg, self.params = bh.from_torch(self.model)
        self.hf = [p for p in self.model.parameters()]
        gen = torch.Generator().manual_seed(seed + 1)
        self.ids = torch.randint(0, vocab, (B, L), generator=gen)
        self.y = torch.randint(0, vocab, (B, L), generator=gen)
        self.v_hf = [torch.randn(p.shape, generator=gen) for p in self.hf]
        self.v = self.ours(self.v_hf)

    def ours(self, tensors: list) -> torch.Tensor:
        """A list in the module's layout as our flat vector: the module with those tensors as its weights,
        read by ``from_torch`` (the same reader that gave the parameters)."""
        m = copy.deepcopy(self.model)
        with torch.no_grad():
            for p, t in zip(m.parameters(), tensors):
                p.copy_(t)
        _, vp = bh.from_torch(m)
        return torch.cat([vp[n].reshape(-1) for n in self.params])

    def loss(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            logits = self.model(self.ids).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.y.reshape(-1))


def setup(P: Problem, method: str):
    if method == "gradient":
        return lambda: torch.autograd.grad(P.loss(), P.hf)
    if method == "ours":
        A = bh.hessian_operator(P.params, P.ids, P.cfg, loss="ce", target=P.y)
        return lambda: A @ P.v
    if method == "ours_out":  # A.matvec into one output kept across the products (no fresh n-vector each)
        A = bh.hessian_operator(P.params, P.ids, P.cfg, loss="ce", target=P.y)
        out = torch.empty_like(P.v)
        return lambda: A.matvec(P.v, out=out)
    if method == "ours_base":
        cfg, params = BASE.from_torch(P.model)
        A = BASE.hessian_operator(params, P.ids, cfg, loss="ce", target=P.y)
        return lambda: A @ P.v
    if method == "double_backward":
        def call():
            g = torch.autograd.grad(P.loss(), P.hf, create_graph=True)
            return torch.autograd.grad(g, P.hf, grad_outputs=P.v_hf)
        return call
    if method == "retained":
        g = torch.autograd.grad(P.loss(), P.hf, create_graph=True)
        return lambda: torch.autograd.grad(g, P.hf, grad_outputs=P.v_hf, retain_graph=True)
    raise ValueError(method)


def flat(P: Problem, out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else P.ours(list(out))


def timed(P: Problem, rounds: int, warmup: int, log, methods=METHODS) -> dict:
    methods = tuple(methods) + (("ours_base",) if BASE is not None else ())
    calls = {}
    for m in methods:
        t = time.perf_counter()
        calls[m] = setup(P, m)
        log(f"setup {m}: {time.perf_counter() - t:.1f} s")
    times, results = interleaved.rounds(calls, rounds, warmup, log,
                                        keep=lambda m, out: None if m == "gradient" else flat(P, out))
    ref = results["retained" if "retained" in results else "double_backward"]
    errors = {m: float((results[m] - ref).norm() / ref.norm()) for m in results}
    med = {m: statistics.median(times[m]) for m in methods}
    ratios = {"ratio_ours_base_over_ours": ("ours_base", "ours"), "ratio_double_backward_over_ours": ("double_backward", "ours"),
              "ratio_retained_over_ours": ("retained", "ours"), "ratio_ours_over_gradient": ("ours", "gradient"),
              "ratio_retained_over_ours_out": ("retained", "ours_out"),
              "ratio_double_backward_over_ours_out": ("double_backward", "ours_out")}
    return {"seconds": times, "median_s": med, f"rel_error_vs_{'retained' if 'retained' in results else 'double_backward'}": errors,
            **{k: med[a] / med[b] for k, (a, b) in ratios.items() if a in med and b in med}}


def worker(args) -> int:
    torch.set_num_threads(args.threads)
    B, L = args.worker_shape
    P = Problem(B, L, args.vocab, args.layers, args.d, args.heads, args.seed)
    print(json.dumps({"method": args.worker, **interleaved.peak_of_first_call(lambda: setup(P, args.worker))}))
    return 0


def memory(args, B: int, L: int, log) -> dict:
    flags = ["--worker-shape", str(B), str(L), "--threads", str(args.threads), "--vocab", str(args.vocab), "--layers",
             str(args.layers), "--d", str(args.d), "--heads", str(args.heads), "--seed", str(args.seed)]
    return interleaved.peaks_in_fresh_processes(__file__, METHODS, flags, log)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x32,1x128,4x256", help="comma-separated BxL (default 1x32,1x128,4x256)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default: all; ours is always timed): fewer "
                        "graphs held at once where the model, the cache and the graphs do not fit in one process")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory", action="store_true", help="also each method's peak memory, in fresh processes")
    p.add_argument("--base", default=None, help="also time our product by the package at this commit (ours_base)")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--worker-shape", type=int, nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.base:
        global BASE
        sys.path.insert(0, HERE)
        from threads import base_package

        sys.path.insert(0, base_package(args.base))
        import blockhess_base as BASE

    def log(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    rep = {"benchmark": "model_products", "commit": git_commit(), "environment": environment(),
           "settings": vars(args), "load_average_at_start": load_average(), "shapes": {}}
    methods = [m.strip() for m in args.methods.split(",")]
    if any(m not in METHODS for m in methods) or not {"retained", "double_backward"} & set(methods):
        raise SystemExit(f"--methods: a subset of {','.join(METHODS)} with retained or double_backward (the reference)")
    methods = tuple(m for m in METHODS if m in methods or m == "ours")
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        log(f"shape B={B} L={L}")
        P = Problem(B, L, args.vocab, args.layers, args.d, args.heads, args.seed)
        rep["shapes"][shape] = timed(P, args.rounds, args.warmup, log, methods)
        del P
        if args.memory:
            rep["shapes"][shape]["memory"] = memory(args, B, L, log)
        rep["load_average_at_end"] = load_average()
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
        s = rep["shapes"][shape]
        log(f"{shape}: ours {s['median_s']['ours']:.2f} s, "
            + ", ".join(f"{k.removeprefix('ratio_')} {v:.2f}x" for k, v in s.items() if k.startswith("ratio_"))
            + f", errors {next(v for k, v in s.items() if k.startswith('rel_error'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
