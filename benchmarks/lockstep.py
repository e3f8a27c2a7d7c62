"""``python benchmarks/lockstep.py --out FILE``: every block's own Hessian-vector product of the 25 tensors of
Zhang et al. (NeurIPS 2024, "Why Transformers need Adam: a Hessian perspective") on a Hugging Face
``GPT2LMHeadModel`` (GPT-2-small-sized by default: 12 layers, d = 768, 12 heads, vocabulary 50,257, tied head,
random weights), the mean token cross-entropy on random labels, float32: ``wte`` and, in layers 0, 3, 7, 11,
W_Q, W_K, W_V (``c_attn``'s three column blocks), W_O (``attn.c_proj``), ``mlp.c_fc``, ``mlp.c_proj``.

Three ways to get every block's ``H_bb v_b``, side by side in one process (docs/results.md, "Every block's own
product at once", issue 29):

* ``ours``: one ``D @ v`` of ``D = A.block_diagonal(blocks)`` (``bh.hessian_operator`` on ``bh.from_torch``);
* ``zhang``: their method, per tensor a forward, one ``create_graph=True`` gradient and a full second backward
  (``torch.autograd.grad`` of the tensor's gradient along ``v_b`` w.r.t. every parameter);
* ``retained``: the fair autograd alternative, one ``create_graph=True`` gradient kept (its graph made once, in
  the setup, as our operator's forward and adjoints are) and per tensor one ``torch.autograd.grad`` restricted
  to it by ``inputs=``.

For each ``(B, L)`` of ``--shapes``: the methods timed in interleaved rounds after a warm-up (medians, the order
rotated each round), each block's result checked against ``retained``'s (relative Euclidean error, worst
block); setups timed once. With ``--plan COLUMNS`` ``ours`` is first told that many columns of every
block follow (``D.expect_columns``, what the lock-step estimators do) and makes one product in its set-up,
so that a GPT-2 head forms its per-row matrices there, once, as in an estimator's run; the set-up's time
says what that costs. With ``--memory`` each method in a fresh worker process (``--worker``): the peak
resident memory over its setup and first product, above the process's once the model, inputs and vector are
built. ``os.getloadavg()`` is recorded at the start and end (the ratios, taken in one process, are what
counts on a shared machine). Baselines run on the module (``sdpa`` under the math kernel).
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
import interleaved  # noqa: E402  (benchmarks/, the script's own folder)
from blockhess_lab.runtime import environment, git_commit, load_average  # noqa: E402

METHODS = ("ours", "zhang", "retained")
LAYERS = (0, 3, 7, 11)
TENSORS = ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")  # c_attn's three column blocks, attn.c_proj, mlp.c_fc, mlp.c_proj


class Problem:
    """The model, its parameters read by ``from_torch``, token ids, labels, the 25 blocks and one direction per
    block, in both layouts: ``hf[b] = (module parameter, column slice or None)``."""

    def __init__(self, B: int, L: int, vocab: int, layers: int, d: int, heads: int, seed: int = 0):
        from transformers import GPT2Config, GPT2LMHeadModel

        conf = GPT2Config(vocab_size=vocab, n_positions=max(L, 1024), n_embd=d, n_layer=layers, n_head=heads,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        conf._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        self.model = GPT2LMHeadModel(conf).eval()
        self.cfg, self.params = bh.from_torch(self.model)
        self.all = list(self.model.parameters())
        gen = torch.Generator().manual_seed(seed + 1)
        self.ids = torch.randint(0, vocab, (B, L), generator=gen)
        self.y = torch.randint(0, vocab, (B, L), generator=gen)
        tf = self.model.transformer
        self.blocks, self.hf = ["W_E"], {"W_E": (tf.wte.weight, None)}
        for i in (i for i in LAYERS if i < layers):
            h = tf.h[i]
            for j, t in enumerate(TENSORS):
                name = f"blocks.{i}.{t}"
                self.blocks.append(name)
                self.hf[name] = {"W_O": (h.attn.c_proj.weight, None), "W_1": (h.mlp.c_fc.weight, None),
                                 "W_2": (h.mlp.c_proj.weight, None)}.get(t, (h.attn.c_attn.weight, slice(j * d, (j + 1) * d)))
        self.v = {b: torch.randn(self.params[b].shape, generator=gen) for b in self.blocks}
        self.v_flat = torch.cat([self.v[b].reshape(-1) for b in self.blocks])
        self.v_hf = {}
        for b in self.blocks:  # the block's direction in its module tensor, zero elsewhere in that tensor
            p, cols = self.hf[b]
            t = torch.zeros_like(p)
            (t if cols is None else t[:, cols]).copy_(self.v[b])
            self.v_hf[b] = t

    def loss(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.MATH):
            logits = self.model(self.ids).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.y.reshape(-1))

    def block_of(self, b: str, out: torch.Tensor) -> torch.Tensor:
        _, cols = self.hf[b]
        return out if cols is None else out[:, cols]


def setup(P: Problem, method: str, plan: int = 0):
    """``call() -> {block: H_bb v_b}`` for ``method``; ``plan`` > 0: ``ours`` is told that many columns of
    every block follow (``D.expect_columns``, as the lock-step estimators do) and makes its first product
    here, in the set-up (a GPT-2 head then forms its per-row matrices in it, once)."""
    if method == "ours":
        A = bh.hessian_operator(P.params, P.ids, P.cfg, loss="ce", target=P.y)
        D = A.block_diagonal(P.blocks)
        if plan:
            D.expect_columns({j: plan for j in range(len(P.blocks))})
            D @ P.v_flat

        def call():
            y = D @ P.v_flat
            return {b: y[o:o + s].reshape(P.v[b].shape) for b, o, s in zip(P.blocks, D.offsets, D.sizes)}
        return call
    index = {id(p): i for i, p in enumerate(P.all)}
    if method == "zhang":
        def call():
            out = {}
            for b in P.blocks:
                p, _ = P.hf[b]
                g = torch.autograd.grad(P.loss(), P.all, create_graph=True)
                hv = torch.autograd.grad(g[index[id(p)]], P.all, grad_outputs=P.v_hf[b], allow_unused=True)
                out[b] = P.block_of(b, hv[index[id(p)]])
                del g, hv
            return out
        return call
    if method == "retained":
        g = torch.autograd.grad(P.loss(), P.all, create_graph=True)

        def call():
            out = {}
            for b in P.blocks:
                p, _ = P.hf[b]
                (hv,) = torch.autograd.grad(g[index[id(p)]], inputs=[p], grad_outputs=P.v_hf[b], retain_graph=True)
                out[b] = P.block_of(b, hv)
            return out
        return call
    raise ValueError(method)


def timed(P: Problem, rounds: int, warmup: int, log, plan: int = 0) -> dict:
    calls, setup_s = {}, {}
    for m in METHODS:
        t = time.perf_counter()
        calls[m] = setup(P, m, plan)
        setup_s[m] = time.perf_counter() - t
        log(f"setup {m}: {setup_s[m]:.1f} s")
    times, results = interleaved.rounds(calls, rounds, warmup, log)
    ref = results["retained"]
    errors = {m: max(float((results[m][b] - ref[b]).norm() / ref[b].norm()) for b in P.blocks) for m in results}
    med = {m: statistics.median(times[m]) for m in METHODS}
    return {"seconds": times, "median_s": med, "setup_s": setup_s, "worst_block_rel_error_vs_retained": errors,
            "ratio_zhang_over_ours": med["zhang"] / med["ours"], "ratio_retained_over_ours": med["retained"] / med["ours"]}


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
    p.add_argument("--shapes", default="1x128,1x32", help="comma-separated BxL (default 1x128,1x32)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory", action="store_true", help="also each method's peak memory, in fresh processes")
    p.add_argument("--plan", type=int, default=0, metavar="COLUMNS",
                   help="tell ours that COLUMNS columns of every block follow (as the estimators do) and make its "
                        "first product in its set-up, timed there (default 0: no plan)")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--worker-shape", type=int, nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    rep = {"benchmark": "lockstep", "commit": git_commit(), "environment": environment(), "settings": vars(args),
           "load_average_at_start": load_average(), "getloadavg_at_start": os.getloadavg(), "shapes": {}}
    for shape in args.shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        log(f"shape B={B} L={L}")
        P = Problem(B, L, args.vocab, args.layers, args.d, args.heads, args.seed)
        rep["blocks"] = P.blocks
        rep["shapes"][shape] = timed(P, args.rounds, args.warmup, log, args.plan)
        del P
        if args.memory:
            rep["shapes"][shape]["memory"] = memory(args, B, L, log)
        rep["load_average_at_end"] = load_average()
        rep["getloadavg_at_end"] = os.getloadavg()
        with open(args.out, "w") as f:
            json.dump(rep, f, indent=1)
        s = rep["shapes"][shape]
        log(f"{shape}: ours {s['median_s']['ours']:.2f} s, zhang {s['ratio_zhang_over_ours']:.2f}x, "
            f"retained {s['ratio_retained_over_ours']:.2f}x, worst errors {s['worst_block_rel_error_vs_retained']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
