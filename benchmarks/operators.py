"""``python benchmarks/operators.py --out FILE``: the matrix-free Hessian operator of a Hugging Face
``GPT2Block`` (``bh.hessian_operator`` on ``bh.from_torch(block)``) against autograd's products and the
Hessian libraries, in one process on this CPU (docs/results.md, "The Hessian operator on a GPT-2 block").

Sections (``--sections``, default all):

``products``
    One Hessian-vector product by every method, timed in interleaved rounds after a warm-up (medians,
    rotated order, one process), each result checked against a float64 double backward on the same
    block, inputs and vector: the gradient alone; our operator's product (``A @ v``, and ``A @ V`` with
    ``--k`` columns, per column); double backward recomputing the forward; double backward on a graph
    kept from one ``create_graph=True`` gradient; ``torch.func.jvp(torch.func.grad(f))``; curvlinops
    ``HessianLinearOperator @ v``; PyHessian's product (its ``hessian_vector_product`` on the gradient it
    keeps); hessian-eigenthings ``HessianOperator.matvec``; with ``--base COMMIT``, method ``ours_base``:
    our product by the package at ``COMMIT`` (a ``git archive`` of ``src/blockhess`` imported beside this
    checkout's), timed in the same rounds. Baselines run on the module itself
    (``sdpa`` under the math kernel: the CPU flash kernel has no second derivative).
``memory``
    The same methods, each in a fresh worker process (``--worker METHOD``): the kernel's peak resident
    memory over the method's setup and first product (and over the product alone), above the process's
    memory once the module, the inputs and the vector are built.
``blocks``
    The six weight blocks' own products ``A[a, a] @ v_a`` (``a`` in W_Q, W_K, W_V, W_O, W_1, W_2; our
    W_Q, W_K, W_V are the fused ``c_attn``'s columns) summed, against one full product ``A @ v``.
``eigs``
    The top 5 (largest algebraic) eigenvalues of the six blocks by ``lanczos_eigs``, to a residual
    ``<= 1e-4 |λ_i|`` for every ``i`` (its ``rel="each"``, checked by a final product; its check on the
    complement of the found vectors included; ``--block-size``, ``--ncv`` as ``lanczos_eigs`` takes them); ``--eig-baselines``
    blocks also by hessian-eigenthings ``lanczos`` (Krylov dimensions doubled from 20 until converged;
    the first converged run's time) and by PyHessian's power iteration (``eigenvalues(top_n=5)``,
    relative tolerance ``--pyhessian-tol``, at most ``--pyhessian-iter`` products per eigenvalue), their
    eigenpairs' residuals computed with our operator.

Loss: MSE against a random target (mean over entries), float32, weights of the block's own
initialisation under ``--seed``. ``--threads`` torch threads (default 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402

import blockhess as bh  # noqa: E402
from blockhess_lab.bench_worker import peak_bytes, reset_peak, rss_bytes  # noqa: E402
from blockhess_lab.runtime import environment, load_average, package_version  # noqa: E402

SIZES = {  # name -> (B, L, d, heads, d_ff)
    "issue": (8, 256, 768, 12, 3072),
    "L64": (8, 64, 768, 12, 3072),
    "small": (4, 64, 256, 4, 1024),
    "tiny": (2, 8, 32, 4, 64),
}
SIX = ("W_Q", "W_K", "W_V", "W_O", "W_1", "W_2")
# the module's parameters (GPT2Block's named_parameters order): name -> (our parameters, axis of the stacking)
HF = (
    ("ln_1.weight", ("gamma_1",), 0), ("ln_1.bias", ("beta_1",), 0),
    ("attn.c_attn.weight", ("W_Q", "W_K", "W_V"), 1), ("attn.c_attn.bias", ("b_Q", "b_K", "b_V"), 0),
    ("attn.c_proj.weight", ("W_O",), 0), ("attn.c_proj.bias", ("b_O",), 0),
    ("ln_2.weight", ("gamma_2",), 0), ("ln_2.bias", ("beta_2",), 0),
    ("mlp.c_fc.weight", ("W_1",), 0), ("mlp.c_fc.bias", ("b_1",), 0),
    ("mlp.c_proj.weight", ("W_2",), 0), ("mlp.c_proj.bias", ("b_2",), 0),
)
# our block -> (the module's parameter holding it, its columns there or None for the whole parameter)
BLOCK_IN_HF = {"W_O": ("attn.c_proj.weight", None), "W_1": ("mlp.c_fc.weight", None),
               "W_2": ("mlp.c_proj.weight", None)}
METHODS = ("gradient", "ours", "ours_base", "ours_k", "double_backward", "retained", "jvp_grad", "curvlinops", "pyhessian",
           "eigenthings")
LABEL = {
    "gradient": "gradient alone (autograd, forward + backward)",
    "ours": "ours: A @ v (k = 1)",
    "ours_base": "ours at --base: A @ v (k = 1)",
    "ours_k": "ours: A @ V (k columns), per column",
    "double_backward": "double backward, forward recomputed",
    "retained": "double backward on a retained graph",
    "jvp_grad": "torch.func jvp(grad)",
    "curvlinops": "curvlinops HessianLinearOperator @ v",
    "pyhessian": "PyHessian hessian_vector_product (retained graph)",
    "eigenthings": "hessian-eigenthings HessianOperator.matvec",
}


# ---------------------------------------------------------------------------------------
# the problem


class Problem:
    """The GPT2Block, its parameters read by ``from_torch``, inputs, target and a fixed direction."""

    def __init__(self, size: str, seed: int = 0, dtype=torch.float32, k: int = 8):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        B, L, d, H, d_ff = SIZES[size]
        self.size, self.dims, self.dtype = size, (B, L, d, H, d_ff), dtype
        conf = GPT2Config(n_embd=d, n_head=H, n_inner=d_ff, n_positions=max(L, 1024), resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
        conf._attn_implementation = "sdpa"  # causal when called alone (eager masks nothing without a mask)
        torch.manual_seed(seed)
        block = GPT2Block(conf).eval()
        self.cfg, params = bh.from_torch(block)
        block = block.to(dtype)
        self.params = {n: p.to(dtype) for n, p in params.items()}
        self.names = list(self.params)
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
        self.n = sum(p.numel() for p in self.params.values())

        class Net(torch.nn.Module):  # the block returning its output tensor, attention by the math kernel
            def __init__(self, blk):
                super().__init__()
                self.block = blk

            def forward(self, X):
                with sdpa_kernel(SDPBackend.MATH):
                    out = self.block(X)
                return out if isinstance(out, torch.Tensor) else out[0]

        self.net = Net(block)
        self.hf_params = [p for _, p in self.net.named_parameters()]
        self.hf_names = [n for n, _ in self.net.named_parameters()]
        if self.hf_names != ["block." + h for h, _, _ in HF]:
            raise RuntimeError(f"unexpected GPT2Block parameters {self.hf_names}")
        gen = torch.Generator().manual_seed(seed + 1)
        self.X = torch.randn(B, L, d, generator=gen, dtype=torch.float64).to(dtype)
        self.Y = torch.randn(B, L, d, generator=gen, dtype=torch.float64).to(dtype)
        self.v = torch.randn(self.n, generator=gen, dtype=torch.float64).to(dtype)
        self.V = torch.randn(self.n, k, generator=gen, dtype=torch.float64).to(dtype)
        self.V[:, 0] = self.v
        self.v_hf = self.to_hf(self.v)
        self.base = None  # the package at --base (method ours_base), set by main

    # layouts: our flat vector (canonical order, vec_r) <-> the module's parameter list
    def unflatten(self, flat: torch.Tensor) -> dict:
        out, o = {}, 0
        for n in self.names:
            s = math.prod(self.shapes[n])
            out[n] = flat[o:o + s].reshape(self.shapes[n])
            o += s
        return out

    def to_hf(self, flat: torch.Tensor) -> list:
        ours = self.unflatten(flat)
        return [torch.cat([ours[n] for n in names], axis).contiguous() for _, names, axis in HF]

    def from_hf(self, tensors) -> torch.Tensor:
        ours = {}
        for (_, names, axis), t in zip(HF, tensors):
            sizes = [self.shapes[n][axis] if len(self.shapes[n]) > axis else self.shapes[n][0] for n in names]
            ours.update(zip(names, t.split(sizes, axis)))
        return torch.cat([ours[n].reshape(-1) for n in self.names])

    def loss(self, Z):
        return ((Z - self.Y) ** 2).mean()

    def operator(self):
        return bh.hessian_operator(self.params, self.X, self.cfg, loss="mse", target=self.Y)


# ---------------------------------------------------------------------------------------
# methods: setup(P) -> call; call() returns the product (ours: a flat tensor; else the module's list)


class Skip(Exception):
    pass


def setup_gradient(P):
    def call():
        return torch.autograd.grad(P.loss(P.net(P.X)), P.hf_params)
    return call


def setup_ours(P):
    A = P.operator()
    return lambda: A @ P.v


def setup_ours_base(P):
    """Our product by the package at ``--base`` (a ``git archive`` imported as ``blockhess_base``)."""
    if P.base is None:
        raise Skip("no --base commit given")
    import dataclasses

    cfg = P.base.BlockConfig(**dataclasses.asdict(P.cfg))
    A = P.base.hessian_operator(P.params, P.X, cfg, loss="mse", target=P.Y)
    return lambda: A @ P.v


def setup_ours_k(P):
    A = P.operator()
    return lambda: A @ P.V


def setup_double_backward(P):
    def call():
        g = torch.autograd.grad(P.loss(P.net(P.X)), P.hf_params, create_graph=True)
        return torch.autograd.grad(g, P.hf_params, grad_outputs=P.v_hf)
    return call


def setup_retained(P):
    g = torch.autograd.grad(P.loss(P.net(P.X)), P.hf_params, create_graph=True)
    return lambda: torch.autograd.grad(g, P.hf_params, grad_outputs=P.v_hf, retain_graph=True)


def setup_jvp_grad(P):
    from torch.func import functional_call, grad, jvp

    names = P.hf_names
    primals = {n: p.detach() for n, p in zip(names, P.hf_params)}
    tangents = dict(zip(names, P.v_hf))

    def f(p):
        return P.loss(functional_call(P.net, p, (P.X,)))

    def call():
        out = jvp(grad(f), (primals,), (tangents,))[1]
        return [out[n] for n in names]
    return call


def setup_curvlinops(P):
    try:
        from curvlinops import HessianLinearOperator
    except ImportError as exc:
        raise Skip(f"curvlinops-for-pytorch not installed ({exc})") from exc
    H = HessianLinearOperator(P.net, torch.nn.MSELoss(), P.hf_params, [(P.X, P.Y)], progressbar=False,
                              check_deterministic=False)
    return lambda: H @ P.v_hf


def setup_pyhessian(P):
    try:
        from pyhessian import hessian
        from pyhessian.utils import hessian_vector_product
    except ImportError as exc:
        raise Skip(f"pyhessian not installed ({exc})") from exc
    h = hessian(P.net, torch.nn.MSELoss(), data=(P.X, P.Y), cuda=False)
    return lambda: hessian_vector_product(h.gradsH, h.params, P.v_hf)


def setup_eigenthings(P):
    try:
        import hessian_eigenthings as he
    except ImportError as exc:
        raise Skip(f"hessian-eigenthings not installed ({exc})") from exc
    H = he.HessianOperator(P.net, [(P.X, P.Y)], he.supervised_loss(torch.nn.functional.mse_loss))
    v = torch.cat([t.reshape(-1) for t in P.v_hf])
    sizes = [p.numel() for p in P.hf_params]
    shapes = [p.shape for p in P.hf_params]
    return lambda: [t.reshape(s) for t, s in zip(H.matvec(v).split(sizes), shapes)]


SETUP = {m: globals()[f"setup_{m}"] for m in METHODS}


def as_ours(P, out) -> torch.Tensor:
    """A method's product as our flat vector (the first column of ``ours_k``)."""
    if isinstance(out, torch.Tensor):
        return (out[:, 0] if out.ndim == 2 else out).detach()
    return P.from_hf([t.detach() for t in out])


def reference_hvp(size: str, seed: int) -> tuple[torch.Tensor, float]:
    """The float64 double backward product on the same block, inputs and direction (our layout), and
    the relative difference of our float64 product from it."""
    P64 = Problem(size, seed, torch.float64, k=1)
    g = torch.autograd.grad(P64.loss(P64.net(P64.X)), P64.hf_params, create_graph=True)
    ref = P64.from_hf(torch.autograd.grad(g, P64.hf_params, grad_outputs=P64.v_hf)).detach()
    del g
    ours = P64.operator() @ P64.v
    return ref, float((ours - ref).norm() / ref.norm())


def errors(P, got: torch.Tensor, ref: torch.Tensor) -> dict:
    got = got.double()
    rel = float((got - ref).norm() / ref.norm())
    per = {}
    g, r = P.unflatten(got), P.unflatten(ref)
    for n in P.names:
        if n == "b_K":  # its rows are exactly 0 (docs/derivations.md §18): autograd's are rounding noise
            continue
        per[n] = float((g[n] - r[n]).norm() / r[n].norm())
    worst = max(per, key=per.get)
    return {"rel_err_vs_float64": rel, "worst_param": worst, "worst_param_rel_err": per[worst], "per_param": per,
            "b_K_norm": float(g["b_K"].norm())}


# ---------------------------------------------------------------------------------------
# timing


def timed_rounds(calls: dict, rounds: int, warmup: int, log) -> dict:
    """Warm each call up, then time ``rounds`` rounds, each calling every method once in an order
    rotated by the round (one call a sample); medians and quartiles of the wall-clock time, and the
    median of the process's CPU time per call (on one thread, the time it ran: on a shared machine
    it leaves out the time the process waited for a core)."""
    res = {m: {"times": [], "cpu_times": []} for m in calls}
    for m, c in calls.items():
        for _ in range(warmup):
            t0 = time.perf_counter()
            c()
            res[m].setdefault("warmup_s", []).append(time.perf_counter() - t0)
    order = list(calls)
    for r in range(rounds):
        k = r % len(order)
        for m in order[k:] + order[:k]:
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            calls[m]()
            res[m]["times"].append(time.perf_counter() - t0)
            res[m]["cpu_times"].append(time.process_time() - c0)
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{m} {res[m]['times'][-1]:.2f}s" for m in order))
    for m, e in res.items():
        t = e["times"]
        q = statistics.quantiles(t, n=4, method="inclusive") if len(t) >= 2 else [t[0]] * 3
        e.update(median_s=statistics.median(t), p25_s=q[0], p75_s=q[2], samples=len(t),
                 median_cpu_s=statistics.median(e["cpu_times"]))
    return res


def section_products(P, args, log) -> dict:
    ref, err64 = reference_hvp(P.size, args.seed)
    out = {"ours_float64": {"rel_err_vs_float64": err64}}
    log(f"float64: ours against double backward {err64:.1e}")
    calls = {}
    for m in args.methods:
        e = out.setdefault(m, {})
        t0 = time.perf_counter()
        try:
            call = SETUP[m](P)
        except Skip as exc:
            e["skipped"] = str(exc)
            continue
        except Exception as exc:  # a baseline that breaks is reported
            e["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            continue
        e["setup_s"] = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            r = call()
            e["first_call_s"] = time.perf_counter() - t0
        except Exception as exc:
            e["error"] = f"{type(exc).__name__} in the first call: {exc}".splitlines()[0][:300]
            continue
        if m != "gradient":
            e.update(errors(P, as_ours(P, r), ref))
        del r
        calls[m] = call
        log(f"{m}: setup {e['setup_s']:.2f}s, first call {e['first_call_s']:.2f}s"
            + (f", rel. err {e['rel_err_vs_float64']:.1e}" if "rel_err_vs_float64" in e else ""))
    timing = timed_rounds(calls, args.rounds, args.warmup, log)
    for m, t in timing.items():
        out[m].update(t)
    if "ours_k" in timing:
        out["ours_k"]["k"] = args.k
        out["ours_k"]["per_column_median_s"] = out["ours_k"]["median_s"] / args.k
    return out


# ---------------------------------------------------------------------------------------
# memory: one worker process per method


def worker(args) -> int:
    torch.set_num_threads(args.threads)
    P = Problem(args.size, args.seed, k=args.k)
    if args.base:
        sys.path.insert(0, HERE)
        from threads import base_package

        sys.path.insert(0, base_package(args.base))
        import blockhess_base

        P.base = blockhess_base
    gc.collect()
    res = {"method": args.worker, "rss_built_bytes": rss_bytes()}
    reset_peak()
    try:
        t0 = time.perf_counter()
        call = SETUP[args.worker](P)
        res["setup_s"] = time.perf_counter() - t0
        res["peak_setup_bytes"] = peak_bytes() - res["rss_built_bytes"]
        gc.collect()
        res["rss_after_setup_bytes"] = rss_bytes()
        reset_peak()
        t0 = time.perf_counter()
        call()
        res["call_s"] = time.perf_counter() - t0
        res["peak_call_bytes"] = peak_bytes() - res["rss_after_setup_bytes"]
        res["peak_total_bytes"] = max(res["peak_setup_bytes"], res["rss_after_setup_bytes"] - res["rss_built_bytes"]
                                      + res["peak_call_bytes"])
    except Skip as exc:
        res["skipped"] = str(exc)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    print("RESULT " + json.dumps(res))
    return 0


def section_memory(P, args, log) -> dict:
    out = {}
    for m in args.methods:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", m, "--size", args.size, "--seed", str(args.seed),
               "--k", str(args.k), "--threads", str(args.threads)] + (["--base", args.base] if args.base else [])
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        out[m] = json.loads(line[-1][7:]) if line else {"error": (p.stderr or "no output")[-300:]}
        r = out[m]
        log(f"memory {m}: " + (f"setup + first product {r['peak_total_bytes'] / 2**30:.2f} GiB, product alone "
                                f"{r['peak_call_bytes'] / 2**30:.2f} GiB" if "peak_total_bytes" in r else str(r)))
    return out


# ---------------------------------------------------------------------------------------
# the six blocks' products


def section_blocks(P, args, log) -> dict:
    A = P.operator()
    views = {a: A[a, a] for a in SIX}
    gen = torch.Generator().manual_seed(args.seed + 7)
    vs = {a: torch.randn(views[a].shape[1], generator=gen, dtype=torch.float64).to(P.dtype) for a in SIX}
    calls = {"full": lambda: A @ P.v}
    for a in SIX:
        calls[a] = (lambda a=a: views[a] @ vs[a])
    # a view's product equals the full product's rows of a direction supported on that block
    check = {}
    for a in SIX:
        w = torch.zeros(P.n, dtype=P.dtype)
        off = 0
        for n in P.names:
            s = math.prod(P.shapes[n])
            if n == a:
                w[off:off + s] = vs[a]
                rows = slice(off, off + s)
            off += s
        full = (A @ w)[rows]
        check[a] = float((views[a] @ vs[a] - full).norm() / full.norm())
    log("view against the full product's rows: " + ", ".join(f"{a} {e:.1e}" for a, e in check.items()))
    t = timed_rounds(calls, args.rounds, args.warmup, log)
    six = sum(t[a]["median_s"] for a in SIX)
    six_cpu = sum(t[a]["median_cpu_s"] for a in SIX)
    full_cpu = t["full"]["median_cpu_s"]
    log(f"six views / one full product: wall {six / t['full']['median_s']:.2f}x, CPU {six_cpu / full_cpu:.2f}x; "
        "per view (CPU): " + ", ".join(f"{a} {t[a]['median_cpu_s'] / full_cpu:.2f}x" for a in SIX))
    return {"timing": t, "view_vs_full_rel_err": check, "six_sum_median_s": six, "full_median_s": t["full"]["median_s"],
            "ratio_six_over_full": six / t["full"]["median_s"], "six_sum_median_cpu_s": six_cpu,
            "full_median_cpu_s": full_cpu, "ratio_six_over_full_cpu": six_cpu / full_cpu,
            "ratio_view_over_full_cpu": {a: t[a]["median_cpu_s"] / full_cpu for a in SIX}}


def section_block_products(P, args, log) -> dict:
    """Each weight block's own product: ours (the operator's view) against hessian-eigenthings' per-block
    operator (double backward that recomputes the forward, the gradient w.r.t. that parameter only), the
    product each eigensolver pays per step; the two agree to float32 rounding."""
    A = P.operator()
    gen = torch.Generator().manual_seed(args.seed + 11)
    calls, agree = {}, {}
    for a in SIX:
        view, H = A[a, a], _block_operator_hf(P, a)
        x = torch.randn(view.shape[1], generator=gen, dtype=torch.float64).to(P.dtype)
        ours, theirs = view @ x, H.matvec(x).reshape(-1)
        agree[a] = float((ours - theirs).norm() / theirs.norm())
        calls[f"ours_{a}"] = (lambda view=view, x=x: view @ x)
        calls[f"eigenthings_{a}"] = (lambda H=H, x=x: H.matvec(x))
    log("ours against eigenthings' block product: " + ", ".join(f"{a} {e:.1e}" for a, e in agree.items()))
    t = timed_rounds(calls, args.rounds, args.warmup, log)
    ratio = {a: t[f"eigenthings_{a}"]["median_s"] / t[f"ours_{a}"]["median_s"] for a in SIX}
    ratio_cpu = {a: t[f"eigenthings_{a}"]["median_cpu_s"] / t[f"ours_{a}"]["median_cpu_s"] for a in SIX}
    log("eigenthings / ours per block product (wall): " + ", ".join(f"{a} {r:.2f}x" for a, r in ratio.items()))
    return {"timing": t, "rel_err_vs_eigenthings": agree, "ratio": ratio, "ratio_cpu": ratio_cpu}


# ---------------------------------------------------------------------------------------
# top-5 eigenvalues of each block


class Counted:
    """An operator wrapper counting the columns multiplied."""

    def __init__(self, A):
        self.A, self.count = A, 0
        self.shape, self.dtype, self.device = A.shape, A.dtype, A.device

    def __matmul__(self, X):
        self.count += 1 if X.ndim == 1 else X.shape[1]
        return self.A @ X


def rel_residuals(view, lam, X) -> list:
    """``‖A x_i − λ_i x_i‖ / (|λ_i| ‖x_i‖)`` by one product of our operator."""
    X = X / X.norm(dim=0, keepdim=True)
    return ((view @ X - X * lam).norm(dim=0) / lam.abs()).tolist()


def ours_eigs(view, tol: float, block_size: int = 1, ncv: int | None = None) -> dict:
    """``lanczos_eigs`` to ``‖A x_i − λ_i x_i‖ <= tol·|λ_i|`` for each ``i`` (its default ``rel="each"``), its
    check included; the products counted by the wrapper and checked against the result's own count."""
    from blockhess.operators.estimators import lanczos_eigs

    C = Counted(view)
    t0 = time.perf_counter()
    r = lanczos_eigs(C, k=5, which="LA", tol=tol, block_size=block_size, ncv=ncv)
    dt = time.perf_counter() - t0
    if C.count != r.matvecs:
        raise RuntimeError(f"lanczos_eigs counted {r.matvecs} products, the wrapper {C.count}")
    rel = (r.residuals / r.eigenvalues.abs()).tolist()
    if max(rel) > tol:
        raise RuntimeError(f"a residual above tol·|λ_i|: {rel}")
    return {"time_s": dt, "matvecs": C.count, "check_matvecs": r.check_matvecs, "check_value": r.check_value,
            "eigenvalues": r.eigenvalues.tolist(), "rel_residuals": rel, "restarts": r.restarts,
            "iterations": r.iterations, "time_per_matvec_s": dt / C.count, "block_size": block_size, "ncv": r.ncv}


def _block_operator_hf(P, a):
    """hessian-eigenthings' operator on our block ``a``: its HessianOperator on the module's parameter
    holding ``a`` (W_Q, W_K, W_V: the fused c_attn, restricted to the block's columns)."""
    import hessian_eigenthings as he

    if a in BLOCK_IN_HF:
        name, cols = BLOCK_IN_HF[a]
    else:
        d = P.cfg.d_model
        name, cols = "attn.c_attn.weight", slice(SIX.index(a) * d, (SIX.index(a) + 1) * d)
    H = he.HessianOperator(P.net, [(P.X, P.Y)], he.supervised_loss(torch.nn.functional.mse_loss),
                           param_filter=he.match_names("block." + name))
    if cols is None:
        return H
    shape = dict(P.net.named_parameters())["block." + name].shape

    def mv(v):
        w = v.new_zeros(shape)
        w[:, cols] = v.reshape(shape[0], -1)
        return H.matvec(w.reshape(-1)).reshape(shape)[:, cols].reshape(-1)

    return he.LambdaOperator(mv, shape[0] * (cols.stop - cols.start), dtype=P.dtype)


def eigenthings_eigs(P, a, view, log, max_iter_cap: int, at: int | None = None) -> dict:
    """hessian-eigenthings' ``lanczos`` (no restarts: one Krylov space of ``max_iter`` products) on block
    ``a``: ``max_iter`` doubled from 20 until the run converges, then bisected down to within 10 % of the
    smallest that converges; the smallest converged run's time is the baseline's. With ``at``: one run
    of ``max_iter = at`` (a size an earlier search found), no search."""
    import hessian_eigenthings as he

    H = _block_operator_hf(P, a)
    tries, total = {}, 0.0

    def run(m):
        nonlocal total
        t0 = time.perf_counter()
        r = he.lanczos(H, k=5, max_iter=m, tol=1e-4, which="LA", reorthogonalize=True, seed=0)
        dt = time.perf_counter() - t0
        total += dt
        rel = rel_residuals(view, r.eigenvalues, r.eigenvectors.T)
        ok = bool(r.converged.all()) and max(rel) <= 1e-4
        tries[m] = {"max_iter": m, "time_s": dt, "converged_flag": bool(r.converged.all()), "rel_residuals": rel,
                    "eigenvalues": r.eigenvalues.tolist(), "ok": ok}
        log(f"eigenthings {a}: max_iter {m}: {dt:.1f}s, max rel. residual {max(rel):.1e}, flag {bool(r.converged.all())}")
        return ok

    if at is not None:
        ok = run(at)
        best = tries[at]
        return {"time_s": best["time_s"] if ok else None, "matvecs": at, "converged": ok, "eigenvalues": best["eigenvalues"],
                "rel_residuals": best["rel_residuals"], "search_total_s": None, "tries": list(tries.values())}
    lo, hi = 0, 20
    while not run(hi):
        lo, hi = hi, 2 * hi
        if hi > max_iter_cap:
            return {"converged": False, "tries": list(tries.values()), "search_total_s": total}
    while hi - lo > max(1, hi // 10):
        mid = (lo + hi) // 2
        if run(mid):
            hi = mid
        else:
            lo = mid
    best = tries[hi]
    return {"time_s": best["time_s"], "matvecs": hi, "eigenvalues": best["eigenvalues"],
            "rel_residuals": best["rel_residuals"], "search_total_s": total, "tries": list(tries.values())}


def pyhessian_eigs(P, a, view, log, tol: float, max_iter: int) -> dict:
    from pyhessian import hessian

    if a not in BLOCK_IN_HF:
        return {"skipped": f"{a} is part of the fused c_attn; PyHessian takes whole parameters (requires_grad)"}
    name = "block." + BLOCK_IN_HF[a][0]
    for n, p in P.net.named_parameters():
        p.requires_grad_(n == name)
        p.grad = None
    count = {"n": 0}
    ph = sys.modules["pyhessian.hessian"]  # the module (the package exports its class under the same name)
    orig = ph.hessian_vector_product

    def counted(gradsH, params, v):
        count["n"] += 1
        return orig(gradsH, params, v)

    ph.hessian_vector_product = counted
    try:
        t0 = time.perf_counter()
        h = hessian(P.net, torch.nn.MSELoss(), data=(P.X, P.Y), cuda=False)
        torch.manual_seed(0)
        lam, vecs = h.eigenvalues(maxIter=max_iter, tol=tol, top_n=5)
        dt = time.perf_counter() - t0
    finally:
        ph.hessian_vector_product = orig
        for _, p in P.net.named_parameters():
            p.requires_grad_(True)
            p.grad = None
    X = torch.stack([v[0].detach().reshape(-1) for v in vecs], 1)
    lam_t = torch.tensor(lam, dtype=P.dtype)
    rel = rel_residuals(view, lam_t, X)
    log(f"pyhessian {a}: {dt:.1f}s, {count['n']} products, max rel. residual {max(rel):.1e}")
    return {"time_s": dt, "matvecs": count["n"], "eigenvalues": list(lam), "rel_residuals": rel, "tol": tol,
            "max_iter_per_eigenvalue": max_iter, "converged": max(rel) <= 1e-4}


def section_eigs(P, args, log) -> dict:
    A = P.operator()
    out = {}
    for a in args.eig_blocks.split(","):
        view = A[a, a]
        e = out.setdefault(a, {})
        if "ours" in args.eig_methods:
            e["ours"] = ours_eigs(view, 1e-4, args.block_size, args.ncv)
            log(f"ours {a}: {e['ours']['time_s']:.1f}s, {e['ours']['matvecs']} products, eigenvalues "
                f"{[f'{x:.4g}' for x in e['ours']['eigenvalues']]}, max rel. residual {max(e['ours']['rel_residuals']):.1e}")
            args.partial(out)
        if a in args.eig_baselines and "eigenthings" in args.eig_methods:
            e["eigenthings"] = eigenthings_eigs(P, a, view, log, args.eigenthings_cap, args.eigenthings_at)
            args.partial(out)
        if a in args.eig_baselines and "pyhessian" in args.eig_methods:
            e["pyhessian"] = pyhessian_eigs(P, a, view, log, args.pyhessian_tol, args.pyhessian_iter)
            args.partial(out)
    return out


# ---------------------------------------------------------------------------------------
# tables from the JSON


def _t(x) -> str:
    return "—" if x is None else f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.0f} ms"


def report(paths: list) -> str:
    """Markdown tables of runs' JSON (each section where a run has it)."""
    out = []
    w = out.append
    for path in paths:
        r = json.load(open(path))
        z, env = r["size"], r["env"]
        w(f"**{os.path.basename(path)}**: B = {z['B']}, L = {z['L']}, d = {z['d']}, {z['heads']} heads, d_ff = {z['d_ff']}, "
          f"n = {z['n']:,}; torch {env['torch']}, {env['torch_threads']} thread(s), {env['date']}.")
        w("")
        sec = r["sections"]
        if "products" in sec:
            p = sec["products"]
            w(f"Products (load average {p['load_average_before'][0]:.1f} before, {p['load_average_after'][0]:.1f} after; "
              f"float64: ours against double backward {p['ours_float64']['rel_err_vs_float64']:.1e}):")
            w("")
            w("| method | wall median [quartiles] | CPU median | method / ours, wall (median of rounds) | method / ours, CPU "
              "| rel. err. vs float64 | worst parameter |")
            w("|---|---|---|---|---|---|---|")
            o = p.get("ours", {})
            for m in METHODS:
                e = p.get(m)
                if not e:
                    continue
                if "median_s" not in e:
                    w(f"| {LABEL[m]} | {e.get('skipped') or e.get('error')} | | | | | |")
                    continue
                per = e.get("k", 1)
                med = e["median_s"] / per
                cpu = e["median_cpu_s"] / per if "median_cpu_s" in e else None
                if m == "ours" or not o.get("times"):
                    rw = rc = "—"
                else:
                    ratios = [a / per / b for a, b in zip(e["times"], o["times"])]
                    rw = f"{statistics.median(ratios):.2f}"
                    rc = f"{cpu / o['median_cpu_s']:.2f}" if cpu is not None and "median_cpu_s" in o else "—"
                err = f"{e['rel_err_vs_float64']:.1e}" if "rel_err_vs_float64" in e else "—"
                worst = f"{e['worst_param']} {e['worst_param_rel_err']:.1e}" if "worst_param" in e else "—"
                label = LABEL[m].replace("k columns", f"k = {per} columns")
                w(f"| {label} | {_t(med)} [{_t(e['p25_s'] / per)}–{_t(e['p75_s'] / per)}] | {_t(cpu)} | {rw} | {rc} | {err} | {worst} |")
            w("")
        if "memory" in sec:
            w("Peak resident memory above the built problem (a worker process per method):")
            w("")
            w("| method | setup + first product | the product alone |")
            w("|---|---|---|")
            for m, e in sec["memory"].items():
                if isinstance(e, dict) and "peak_total_bytes" in e:
                    label = LABEL[m].replace("k columns), per column", f"k = {r['args']['k']} columns)")
                    w(f"| {label} | {e['peak_total_bytes'] / 2**30:.2f} GiB | {e['peak_call_bytes'] / 2**30:.2f} GiB |")
            w("")
        if "blocks" in sec:
            b = sec["blocks"]
            t = b["timing"]
            cells = " | ".join(f"{a} {_t(t[a]['median_s'])}" for a in SIX)
            w(f"Six blocks (load average {b['load_average_before'][0]:.1f}): full product {_t(b['full_median_s'])}; {cells}; "
              f"sum {_t(b['six_sum_median_s'])}, sum / full = {b['ratio_six_over_full']:.2f} (CPU: "
              f"{sum(t[a]['median_cpu_s'] for a in SIX) / t['full']['median_cpu_s']:.2f})." if "median_cpu_s" in t["full"] else
              f"Six blocks: sum / full = {b['ratio_six_over_full']:.2f}.")
            w("")
        if "eigs" in sec:
            g = sec["eigs"]
            w(f"Top 5 eigenvalues per block (load average {g['load_average_before'][0]:.1f}):")
            w("")
            w("| block | ours: products, time | ours: eigenvalues (max rel. residual) | eigenthings: Krylov size, time "
              "(search total) | PyHessian: products, time (max rel. residual) |")
            w("|---|---|---|---|---|")
            for a in SIX:
                e = g.get(a)
                if not isinstance(e, dict):
                    continue
                ou = e["ours"]
                lam = ", ".join(f"{x:.4g}" for x in ou["eigenvalues"])
                et, ph = e.get("eigenthings", {}), e.get("pyhessian", {})
                etc = (f"{et['matvecs']}, {_t(et['time_s'])} ({_t(et['search_total_s'])})" if "time_s" in et else
                       "not converged" if et else "—")
                phc = (f"{ph['matvecs']}, {_t(ph['time_s'])} ({max(ph['rel_residuals']):.1e})" if "time_s" in ph else
                       ph.get("skipped", "—") if ph else "—")
                w(f"| {a} | {ou['matvecs']}, {_t(ou['time_s'])} | {lam} ({max(ou['rel_residuals']):.1e}) | {etc} | {phc} |")
            w("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="issue", help="(B, L, d, heads, d_ff): " +
                    ", ".join(f"{k} {v}" for k, v in SIZES.items()))
    ap.add_argument("--sections", default="products,memory,blocks,eigs",
                    help="comma-separated, of products, memory, blocks, block_products, eigs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--k", type=int, default=8, help="columns of the batched product")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--methods", default=",".join(m for m in METHODS if m != "ours_base"),
                    help="products: the methods to run (ours_base: with --base)")
    ap.add_argument("--base", default=None, help="products: the commit whose package method ours_base runs")
    ap.add_argument("--block-size", type=int, default=1, help="eigs: lanczos_eigs's block_size")
    ap.add_argument("--ncv", type=int, default=None, help="eigs: lanczos_eigs's ncv (default its own)")
    ap.add_argument("--eig-blocks", default=",".join(SIX), help="eigs: the blocks")
    ap.add_argument("--eig-methods", default="ours,eigenthings,pyhessian", help="eigs: which of ours, eigenthings, pyhessian")
    ap.add_argument("--eig-baselines", default="W_1", help="blocks whose top 5 the baselines also compute")
    ap.add_argument("--eigenthings-cap", type=int, default=640, help="largest Krylov dimension tried")
    ap.add_argument("--eigenthings-at", type=int, default=None,
                    help="eigs: one eigenthings run of this Krylov dimension (found by an earlier search) instead of the search")
    ap.add_argument("--pyhessian-tol", type=float, default=1e-8)
    ap.add_argument("--pyhessian-iter", type=int, default=200)
    ap.add_argument("--out", help="JSON file")
    ap.add_argument("--report", nargs="+", metavar="JSON", help="print the markdown tables of these runs and exit")
    ap.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.report:
        print(report(args.report))
        return 0
    torch.set_num_threads(args.threads)
    args.eig_baselines = [b for b in args.eig_baselines.split(",") if b]
    bad = set(args.methods.split(",")) - set(METHODS)
    if bad:
        raise SystemExit(f"--methods: unknown {sorted(bad)}; choose from {METHODS}")
    args.methods = [m for m in METHODS if m in args.methods.split(",")]
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    P = Problem(args.size, args.seed, k=args.k)
    if args.base:
        sys.path.insert(0, HERE)
        from threads import base_package

        sys.path.insert(0, base_package(args.base))
        import blockhess_base

        P.base = blockhess_base
    B, L, d, H, d_ff = P.dims
    result = {"size": dict(name=args.size, B=B, L=L, d=d, heads=H, d_ff=d_ff, n=P.n), "loss": "mse", "dtype": "float32",
              "args": {k: v for k, v in vars(args).items() if k not in ("worker", "partial")},
              "env": {**environment("cpu"), "torch_threads": torch.get_num_threads(),
                      "curvlinops": package_version("curvlinops-for-pytorch"), "pyhessian": package_version("pyhessian"),
                      "hessian_eigenthings": package_version("hessian-eigenthings"),
                      "transformers": package_version("transformers")},
              "sections": {}}
    log(f"size {args.size}: B={B}, L={L}, d={d}, heads={H}, d_ff={d_ff}, n={P.n:,}; load {load_average()}")

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    def partial(body):  # a long section's results so far, saved as it goes
        result["sections"][f"{s}_partial"] = body
        save()

    args.partial = partial
    for s in [s for s in args.sections.split(",") if s]:
        load0 = load_average()
        t0 = time.perf_counter()
        body = {"products": section_products, "memory": section_memory, "blocks": section_blocks,
                "block_products": section_block_products, "eigs": section_eigs}[s](P, args, log)
        result["sections"].pop(f"{s}_partial", None)
        result["sections"][s] = {"load_average_before": load0, "load_average_after": load_average(),
                                 "wall_s": time.perf_counter() - t0, **body}
        save()
    result["total_s"] = time.perf_counter() - t_start
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
