"""``blockhess bench``: the closed forms against autograd, for speed, memory and agreement.

What is measured (benchmarks/README.md; the targets are the project's, beside the paper's figures):

(a) the paper's size (L, d, d_ff) = (8, 16, 32), float32 and float64: the LayerNorm
    Jacobian, dZ/dW_1, dZ/dW_2 and the full block Jacobian, dense on both sides, against
    ``torch.autograd.functional.jacobian`` (the paper's baseline) and ``torch.func``
    ``jacrev`` / ``jacfwd``;
(b) the full loss Hessian in float64, MSE and CE, at (8, 16, 32), (16, 32, 64),
    (32, 64, 128), a batch of 128 scikit-learn digits (the report's setting) and a real
    ``torch.nn.TransformerEncoderLayer`` (4 heads, biases, ``W_O``, affine LayerNorms), against
    ``torch.autograd.functional.hessian``, ``torch.func.hessian``, curvlinops
    ``HessianLinearOperator @ I`` and JAX ``jit(hessian)`` (compile time apart), with the
    floor: allocating and filling the dense n×n output;
(c) the largest n whose full Hessian the closed form computes within the memory cap, and
    whether each baseline can;
(m) the Hessian of a whole model's loss in float64, dense: the 2-block digits ViT (B = 8 and
    32 digits) and a 2-layer GPT-2 (d = 16, 2 heads, vocabulary 32, 8 positions; B = 8), against
    ``torch.func.hessian`` and curvlinops ``HessianLinearOperator @ I`` in column blocks of 256,
    with the floor (:func:`model_cases`, :class:`~blockhess_lab.bench_worker.ModelProblem`).

How: every job runs in a fresh subprocess (:mod:`blockhess_lab.bench_worker`)
watched by this process, which kills it when its resident memory passes the cap or the
machine runs low (recorded as out of memory) or when it runs past its time limit. Within
a job the methods are warmed up and timed in interleaved rounds (median and quartiles);
ratios compare methods timed in the same process (where the closed form cannot run again
beside a baseline at the largest size, its warm median from another process, flagged). Peak
memory is each method's first
call in a fresh process (the kernel's high-water mark, reset just before the call). Every
output is checked against the closed form's (relative Frobenius error, or a fixed random
sketch when the two cannot be held at once). Baselines that are not installed are
reported as skipped, with the reason.

Writes ``bench.json`` (everything, with the environment), ``bench.md`` (tables, the
paper's figures beside ours, the targets) and ``bench.png`` into ``--out``.

``--device cuda`` runs groups (a), (b) and (m) on the GPU (the paper's timings are CUDA, FP32):
every timed call ends with ``torch.cuda.synchronize()``, peak memory is the GPU memory
allocated by torch, JAX is skipped (CPU jaxlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from .outputs import MARKER, check_out
from .runtime import GiB, add_quiet_argument, environment, load_average, package_version, positive_int

HELP = "time and memory of the closed forms against autograd baselines (JSON, markdown, plot)"


# the paper's timing table (the authors' thesis slides; CUDA, FP32, mean ± std)
PAPER = {
    "ln": {"autograd_ms": 55.96, "closed_ms": 0.80, "speedup": 70.0, "target": 82.0},
    "W_1": {"autograd_ms": 55.85, "closed_ms": 0.45, "speedup": 124.0, "target": 124.0},
    "W_2": {"autograd_ms": 57.81, "closed_ms": 0.13, "speedup": 445.0, "target": 445.0},
}
# the issue's measurements on a 2-core, 24 GB machine (float64, MSE, warm)
ISSUE_HESSIAN = {
    (8, 16, 32): {"func_hessian": "≈0.03 s", "jax": "≈0.04 s"},
    (16, 32, 64): {"func_hessian": "0.6–1.2 s", "jax": "≈0.7 s", "floor": "0.1–0.2 s"},
    (32, 64, 128): {"func_hessian": "≈40 s, 21 GB peak", "jax": "≈19 s, 19.6 GB peak", "floor": "1.2–1.7 s"},
}

METHOD_LABEL = {
    "closed_form": "closed form (blockhess)",
    "closed_form_out": "closed form into a reused out=",
    "floor": "floor: allocate + fill n×n",
    "autograd": "torch.autograd.functional",
    "jacrev": "torch.func.jacrev",
    "jacfwd": "torch.func.jacfwd",
    "func_hessian": "torch.func.hessian",
    "curvlinops": "curvlinops H @ I",
    "jax": "jax.jit(jax.hessian)",
}
JAC_METHODS = ["closed_form", "autograd", "jacrev", "jacfwd"]
HESS_METHODS = ["closed_form", "closed_form_out", "floor", "func_hessian", "jax", "curvlinops", "autograd"]
MODEL_METHODS = ["closed_form", "floor", "func_hessian", "curvlinops"]
MODEL_BASELINES = ("func_hessian", "curvlinops")
NO_PEAK = ("floor", "closed_form_out")  # not in the memory table: the floor is its output; out= is allocated before the call
JAC_LABEL = {"ln": "LayerNorm Jacobian", "W_1": "dZ/dW_1", "W_2": "dZ/dW_2", "block": "full block Jacobian dZ/dW"}


def _threads(text: str) -> int | None:
    """``--threads``: ``auto`` (``None``: chosen at start by :func:`_choose_threads`) or an integer >= 1."""
    if text.strip().lower() == "auto":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or an integer >= 1, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="output folder, written case by case (bench.json, bench.md, bench.png); an existing folder must be "
                        "empty or hold earlier results (default: bench-results)")
    p.add_argument("--quick", action="store_true", help="small sizes and few rounds: a smoke run of groups a, b, c and m (float32 only in a; fewer memory jobs and baselines; about 2 minutes on 2 quiet cores, 4-5 on 2 loaded ones); its numbers do not test the targets")
    p.add_argument("--cases", default="a,b,c,m", metavar="LIST", help="comma-separated groups to run: a (component Jacobians), b (full Hessians), c (largest n), m (whole models) (default: a,b,c,m)")
    p.add_argument("--only", default="", metavar="LIST", help="comma-separated substrings: run only the cases whose id contains one (e.g. b/mse/32x64x128)")
    p.add_argument("--mem-cap-gb", type=float, default=20.0, metavar="GIB", help="memory cap per job in GiB; a job whose resident memory passes it is killed and reported out of memory (default: 20)")
    p.add_argument("--slow", action="store_true", help="also run torch.autograd.functional.hessian at (32, 64, 128) (n Hessian-vector passes: many minutes)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-method peak-memory subprocesses of groups a, b and m")
    p.add_argument("--threads", type=_threads, default=None, metavar="auto|N",
                   help="threads per worker for torch and JAX: an integer >= 1, or auto (the default): torch's default, "
                   "but 1 when the machine is oversubscribed at start (load average >= CPUs), where OpenMP "
                   "barriers stall multi-threaded runs; bench.json records the count and why (threads_reason)")
    p.add_argument("--disable", default=os.environ.get("BLOCKHESS_BENCH_DISABLE", ""), metavar="LIST", help="comma-separated baselines to skip as if not installed (e.g. jax,curvlinops)")
    add_quiet_argument(p, "tables printed at the end (bench.md has them)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the problems live and every torch method runs (default: cpu). cuda: groups a, b and m only "
                   "(group c's memory cap watches host memory), JAX skipped (CPU jaxlib), peak memory is the GPU's")


# ---------------------------------------------------------------------------------------
# environment


def _settings(args) -> dict:
    """What bench adds to :func:`~blockhess_lab.runtime.environment` in ``bench.json``'s ``env``: the
    workers' threads and why, the device, the baselines' versions, the memory cap, what was disabled."""
    return {
        "torch_threads": args.effective_threads,
        "threads_reason": args.threads_reason,
        "device": args.device,
        "jax": package_version("jax"),
        "jaxlib": package_version("jaxlib"),
        "curvlinops": package_version("curvlinops-for-pytorch"),
        "mem_cap_gib": args.mem_cap_gb,
        "disabled": [d for d in args.disable.split(",") if d],
        "note": "timings are wall-clock medians of interleaved rounds after warm-up; a shared machine adds noise, "
        "see load averages per job",
    }


# ---------------------------------------------------------------------------------------
# the plan


def _problem(kind, L, d, d_ff, dtype="float64", loss="mse", B=0, of=None, ln_eps=0.0, heads=0):
    p = {"kind": kind, "L": L, "d": d, "d_ff": d_ff, "B": B, "dtype": dtype, "loss": loss, "seed": 0, "ln_eps": ln_eps}
    if of:
        p["of"] = of
    if heads:
        p["heads"] = heads
    return p


def _n(L, d, d_ff):
    return 3 * d * d + 2 * d * d_ff


def build_plan(args) -> list[dict]:
    """The list of cases; each has an id, a group, its problem and its jobs."""
    groups = {g.strip() for g in args.cases.split(",") if g.strip()}
    bad = groups - {"a", "b", "c", "m"}
    if bad:
        raise ValueError(f"--cases must be a comma-separated subset of a,b,c,m; got {sorted(bad)}")
    if args.device == "cuda":
        groups.discard("c")  # the largest-n search caps host memory; on a GPU it would measure the wrong thing
        if not groups:
            raise ValueError("--device cuda runs groups a, b and m only (group c watches host memory); got --cases c")
    q = args.quick
    mem = not args.no_memory
    cases = []
    if "a" in groups:
        for dtype in ("float32",) if q else ("float32", "float64"):
            for of in ("ln", "W_1", "W_2", "block"):
                prob = _problem("jacobian", 8, 16, 32, dtype, of=of)
                cases.append({
                    "id": f"a/{of}/{dtype}", "group": "a", "problem": prob, "layout": "interleaved",
                    "methods": JAC_METHODS, "memory": mem and not q,
                    "time": {"rounds": 3 if q else 15, "min_sample_s": 0.005 if q else 0.05, "method_budget_s": 1 if q else 20, "warmup": 1 if q else 2},
                    "timeout_s": 300 if q else 900,
                })
    if "b" in groups:
        sizes = [(4, 8, 16)] if q else [(8, 16, 32), (16, 32, 64)]
        for L, d, d_ff in sizes:
            for loss in ("mse", "ce"):
                big = d >= 32
                cases.append({
                    "id": f"b/{loss}/{L}x{d}x{d_ff}", "group": "b", "problem": _problem("hessian", L, d, d_ff, loss=loss),
                    "layout": "interleaved", "methods": HESS_METHODS, "memory": mem,
                    "memory_methods": ["closed_form", "func_hessian"] if q else [m for m in HESS_METHODS if m not in NO_PEAK and not (big and m == "autograd")],
                    "time": {"rounds": 3 if q else (7 if big else 15), "min_sample_s": 0.01 if q else 0.05,
                             "method_budget_s": 2 if q else (60 if big else 20), "warmup": 1 if q else 2},
                    "timeout_s": 300 if q else 1800,
                })
        # the report's digits ViT (experiments/vit.py DEFAULT_ARCH): 2x2 patches -> L = 16, d = 16, d_ff = 32, eps 1e-5,
        # loss = cross-entropy of a linear head on the mean-pooled tokens, one batch of 128
        dig = (4, 4, 8, 16) if q else (128, 16, 16, 32)
        cases.append({
            "id": f"b/digits/B{dig[0]}", "group": "b",
            "problem": _problem("hessian", dig[1], dig[2], dig[3], loss="digits", B=dig[0], ln_eps=1e-5),
            "layout": "interleaved", "methods": HESS_METHODS, "memory": mem, "memory_methods": ["closed_form"] if q else [m for m in HESS_METHODS if m not in NO_PEAK],
            "time": {"rounds": 3 if q else 11, "min_sample_s": 0.01 if q else 0.05, "method_budget_s": 2 if q else 30, "warmup": 1 if q else 2},
            "timeout_s": 300 if q else 1800,
        })
        # a real PyTorch layer: nn.TransformerEncoderLayer (4 heads, biases, W_O, affine LayerNorms) via from_torch
        L, d, d_ff = (4, 8, 16) if q else (16, 32, 64)
        cases.append({
            "id": f"b/mse/torch-layer-{L}x{d}x{d_ff}-4heads", "group": "b", "problem": _problem("hessian", L, d, d_ff, heads=4),
            "layout": "interleaved", "methods": HESS_METHODS, "memory": mem,
            "memory_methods": ["closed_form", "func_hessian"] if q else [m for m in HESS_METHODS if m not in NO_PEAK and m != "autograd"],
            "time": {"rounds": 3 if q else 7, "min_sample_s": 0.01 if q else 0.05, "method_budget_s": 2 if q else 60, "warmup": 1 if q else 2},
            "timeout_s": 300 if q else 1800,
        })
        # the large size: one process per baseline, each with the closed form interleaved
        L, d, d_ff = (4, 8, 16) if q else (32, 64, 128)
        for loss in ("mse",) if q else ("mse", "ce"):
            pairs = ["floor", "closed_form_out", "func_hessian", "jax"] if loss == "mse" else ["floor", "jax"]
            if loss == "mse" and not q:
                pairs += ["curvlinops"] + (["autograd"] if args.slow else [])
            cases.append({
                "id": f"b/{loss}/{L}x{d}x{d_ff}" + ("/paired" if q else ""), "group": "b", "problem": _problem("hessian", L, d, d_ff, loss=loss),
                "layout": "paired", "methods": ["closed_form"] + pairs, "pairs": pairs, "memory": False,
                "time": {"rounds": 2 if q else 3, "min_sample_s": 0.0, "method_budget_s": 5 if q else 300, "warmup": 1 if q else 0, "exact": False},
                "timeout_s": 300 if q else 1500,
                "skipped": {} if (args.slow or q or loss != "mse") else {"autograd": "not run at this size without --slow: n = 28,672 Hessian-vector passes (see its time at (16, 32, 64))"},
            })
    if "m" in groups:
        cases += model_cases(q, mem)
    if "c" in groups:
        sizes = [(4, 8, 16)] if q else [(32, 72, 144), (32, 80, 160), (32, 84, 168)]
        cases.append({
            "id": "c/largest", "group": "c", "sizes": sizes, "layout": "largest",
            "baselines": ["func_hessian"] if q else ["func_hessian", "jax", "curvlinops"], "timeout_s": 300 if q else 1200,
        })
    only = getattr(args, "only", "")
    cases = matching(cases, only)
    if not cases:
        raise ValueError(f"--only {only!r} matches no case of groups {sorted(groups)}")
    return cases


def matching(cases: list[dict], only: str) -> list[dict]:
    """The cases whose id contains one of the comma-separated substrings ``only`` (``""``: every case)."""
    subs = [o.strip() for o in only.split(",") if o.strip()]
    return [c for c in cases if not subs or any(o in c["id"] for o in subs)]


GPT2 = {"d": 16, "d_ff": 64, "heads": 2, "vocab": 32, "positions": 8}  # the issue's 2-layer GPT-2: n = 7,232
GPT2_QUICK = {"d": 8, "d_ff": 16, "heads": 2, "vocab": 8, "positions": 4}


def model_cases(quick: bool, mem: bool) -> list[dict]:
    """Group (m): whole models (:class:`~blockhess_lab.bench_worker.ModelProblem`), float64, CE.

    The digits ViT at B = 8 in one process (all methods interleaved, peak memory from fresh
    processes); at B = 32 and the GPT-2 at B = 8, where one baseline call takes about a minute,
    each baseline in its own process with the closed form interleaved (the floor's process gives
    the closed form's fresh peak). curvlinops multiplies column blocks of 256 identity columns
    (the fastest of 1,024, 256 and 64: benchmarks/baseline_settings.py). Quick: one block, B = 2,
    a GPT-2 of width 8."""
    def spec(model, B, **kw):
        return {"kind": "model", "model": model, "B": B, "blocks": 1 if quick else 2, "dtype": "float64", "seed": 0,
                "columns": 256, **kw}

    if quick:
        t = {"rounds": 3, "min_sample_s": 0.01, "method_budget_s": 2, "warmup": 1}
        return [
            {"id": "m/vit/B2", "group": "m", "problem": spec("vit", 2), "layout": "interleaved", "methods": MODEL_METHODS,
             "memory": mem, "memory_methods": ["closed_form"], "time": t, "timeout_s": 300},
            {"id": "m/gpt2/B2/paired", "group": "m", "problem": spec("gpt2", 2, **GPT2_QUICK), "layout": "paired",
             "methods": MODEL_METHODS, "pairs": ["floor", *MODEL_BASELINES], "memory": False, "time": {**t, "exact": True}, "timeout_s": 300},
        ]
    return [
        {"id": "m/vit/B8", "group": "m", "problem": spec("vit", 8), "layout": "interleaved", "methods": MODEL_METHODS,
         "memory": mem, "memory_methods": ["closed_form", *MODEL_BASELINES],
         "time": {"rounds": 7, "min_sample_s": 0.05, "method_budget_s": 40, "warmup": 1}, "timeout_s": 900},
        {"id": "m/vit/B32", "group": "m", "problem": spec("vit", 32), "layout": "paired", "methods": MODEL_METHODS,
         "pairs": ["floor", *MODEL_BASELINES], "memory": False,
         "time": {"rounds": 5, "min_sample_s": 0.05, "method_budget_s": 60, "warmup": 1, "exact": True}, "timeout_s": 900},
        {"id": "m/gpt2/B8", "group": "m", "problem": spec("gpt2", 8, **GPT2), "layout": "paired", "methods": MODEL_METHODS,
         "pairs": ["floor", *MODEL_BASELINES], "memory": False,
         "time": {"rounds": 3, "min_sample_s": 0.05, "method_budget_s": 60, "warmup": 1, "exact": True}, "timeout_s": 900},
    ]


# ---------------------------------------------------------------------------------------
# running jobs


class Runner:
    """Starts worker subprocesses one at a time and watches their memory and time."""

    def __init__(self, args, workdir: str):
        self.args = args
        self.workdir = workdir
        self.cap = int(args.mem_cap_gb * GiB)
        self.count = 0
        self.disabled = {d.strip() for d in args.disable.split(",") if d.strip()}

    def run(self, job: dict, timeout_s: float) -> dict:
        self.count += 1
        job = dict(job)
        job["disabled"] = sorted(self.disabled)
        job["threads"] = self.args.effective_threads
        job["device"] = self.args.device
        jp = os.path.join(self.workdir, f"job{self.count}.json")
        op = os.path.join(self.workdir, f"out{self.count}.json")
        lp = os.path.join(self.workdir, f"log{self.count}.txt")
        with open(jp, "w") as f:
            json.dump(job, f)
        vm = psutil.virtual_memory()
        # never let a job take what others on a shared machine are using: cap at what is free now, less a reserve
        cap = int(min(self.cap, vm.available - 1.5 * GiB))
        info = {"load_before": load_average(), "available_gib_before": round(vm.available / GiB, 2), "cap_gib": round(cap / GiB, 2)}
        env = dict(os.environ)
        env.setdefault("PYTHONWARNINGS", "ignore")
        nt = str(self.args.effective_threads)
        env.update(OMP_NUM_THREADS=nt, MKL_NUM_THREADS=nt, OPENBLAS_NUM_THREADS=nt)
        if self.args.effective_threads == 1:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
        t0 = time.perf_counter()
        with open(lp, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "blockhess_lab.bench_worker", jp, op], stdout=log, stderr=subprocess.STDOUT, env=env)
            killed, max_rss = None, 0
            ps = psutil.Process(proc.pid)
            while proc.poll() is None:
                try:
                    rss = ps.memory_info().rss
                except psutil.Error:
                    rss = 0
                max_rss = max(max_rss, rss)
                avail = psutil.virtual_memory().available
                if rss > cap:
                    killed = f"out of memory: resident memory passed the cap of {cap / GiB:.1f} GiB (the --mem-cap-gb, or what was free, less 1.5 GiB)"
                elif avail < 0.6 * GiB:
                    killed = f"out of memory: the machine ran low (available {avail / GiB:.2f} GiB, process at {rss / GiB:.1f} GiB)"
                elif time.perf_counter() - t0 > timeout_s:
                    killed = f"timeout: still running after {timeout_s:.0f} s"
                if killed:
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(0.05)
        info.update(wall_s=round(time.perf_counter() - t0, 2), load_after=load_average(), watched_max_rss_gib=round(max_rss / GiB, 3))
        result = None
        if not killed and os.path.exists(op):
            with open(op) as f:
                result = json.load(f)
        if result is None:
            with open(lp) as f:
                tail = f.read()[-1500:]
            result = {"status": "killed" if killed else "error", "error": killed or f"worker exited with {proc.returncode}", "log_tail": tail}
        result["watch"] = info
        return result


# ---------------------------------------------------------------------------------------
# cases


def _sketch_err(a: dict, b: dict) -> float | None:
    if not a or not b or "sketch" not in a or "sketch" not in b:
        return None
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a["sketch"], b["sketch"])))
    den = math.sqrt(sum(y * y for y in b["sketch"]))
    return num / den if den else None


def _strip(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "sketch"}


def run_interleaved(case: dict, runner: Runner, progress) -> dict:
    methods = [m for m in case["methods"] if m not in runner.disabled]
    skipped = {m: "disabled (--disable / BLOCKHESS_BENCH_DISABLE): treated as not installed" for m in case["methods"] if m in runner.disabled}
    job = {"mode": "time", "problem": case["problem"], "methods": methods, **case["time"]}
    progress(f"{case['id']}: timing {', '.join(methods)}")
    res = runner.run(job, case["timeout_s"])
    out = {"time_job": {k: v for k, v in res.items() if k not in ("methods", "job")}, "methods": {}}
    for k in ("n", "rows", "cols", "out_bytes"):
        out[k] = res.get(k)
    ms = res.get("methods", {})
    cf = ms.get("closed_form", {})
    for m in case["methods"]:
        e = dict(ms.get(m, {}))
        if m in skipped:
            e = {"available": False, "skip_reason": skipped[m]}
        elif not e:
            e = {"available": False, "error": res.get("error", "not run")}
        if m not in ("closed_form", "floor") and "sketch" in e:
            e["sketch_rel_err"] = _sketch_err(e, cf)
        out["methods"][m] = _strip(e)
    if case.get("memory"):
        for m in case.get("memory_methods") or methods:
            if m not in methods:
                continue
            if not out["methods"][m].get("available", False):
                continue
            progress(f"{case['id']}: peak memory of {m} (fresh process)")
            r = runner.run({"mode": "memory", "problem": case["problem"], "methods": [m]}, case["timeout_s"])
            e = r.get("methods", {}).get(m, {})
            mem = {k: e.get(k) for k in ("peak_rss_bytes", "peak_delta_bytes", "rss_before_bytes", "first_call_s", "compile_s", "peak_reset")}
            mem["status"] = r.get("status") if "error" not in e else "error"
            if r.get("status") != "ok" or "error" in e:
                mem["error"] = e.get("error") or r.get("error")
            mem["watch"] = r.get("watch")
            out["methods"][m]["memory"] = mem
    return out


def run_paired(case: dict, runner: Runner, progress) -> dict:
    out = {"methods": {}, "pairs": {}}
    cf_times, cf_mem = [], None
    for m in case["pairs"]:
        if m in case.get("skipped", {}):
            out["methods"][m] = {"available": False, "skip_reason": case["skipped"][m]}
            continue
        if m in runner.disabled:
            out["methods"][m] = {"available": False, "skip_reason": "disabled (--disable / BLOCKHESS_BENCH_DISABLE): treated as not installed"}
            continue
        # the floor's job starts with the closed form (its peak memory); the others start with the baseline
        first = ["closed_form", "floor"] if m == "floor" else [m, "closed_form"]
        progress(f"{case['id']}: {first[0]} then interleaved with {first[1]} (fresh process)")
        job = {"mode": "time", "problem": case["problem"], "methods": first, **case["time"]}
        res = runner.run(job, case["timeout_s"])
        for k in ("n", "rows", "cols", "out_bytes"):
            if res.get(k) is not None:
                out[k] = res[k]
        ms = res.get("methods", {})
        cf = ms.get("closed_form", {})
        e = dict(ms.get(m, {}))
        if not e:
            e = {"available": True, "error": res.get("error", "not run"), **({"log_tail": res["log_tail"]} if "log_tail" in res else {})}
        elif res.get("status") != "ok":
            e.setdefault("error", res.get("error", "not run"))
        if m != "floor" and "sketch" in e:
            e["sketch_rel_err"] = _sketch_err(e, cf)
        first_m = first[0]
        peak_src = ms.get(first_m, {})
        mem = {k: peak_src.get(k) for k in ("peak_rss_bytes", "peak_delta_bytes", "rss_before_bytes", "first_call_s", "peak_reset")}
        if first_m == m:
            e["memory"] = {**mem, "status": "ok" if "peak_rss_bytes" in peak_src else "error", "watch": res.get("watch")}
            if res.get("status") == "killed":
                e["memory"]["error"] = res.get("error")
        elif first_m == "closed_form":
            cf_mem = {**mem, "status": "ok" if "peak_rss_bytes" in peak_src else "error", "watch": res.get("watch")}
            if res.get("status") != "ok":
                cf_mem["error"] = res.get("error")
        e["watch"] = res.get("watch")
        out["methods"][m] = _strip(e)
        if cf.get("median_s") is not None:
            cf_times.append(cf["median_s"])
            out["pairs"][m] = {"closed_form_median_s": cf["median_s"], "closed_form_p25_s": cf.get("p25_s"), "closed_form_p75_s": cf.get("p75_s"),
                               "closed_form_times": cf.get("times"), "closed_form_first_call_s": cf.get("first_call_s")}
            if e.get("median_s"):
                out["pairs"][m]["ratio"] = e["median_s"] / cf["median_s"]
        if m not in out["pairs"] and cf.get("first_call_s") and e.get("first_call_s"):
            # the closed form could not be timed again in this process (e.g. the baseline left memory held):
            # the ratio of the two first calls, flagged as such
            out["pairs"][m] = {"closed_form_first_call_s": cf["first_call_s"], "ratio_first_calls": e["first_call_s"] / cf["first_call_s"]}
        if cf.get("error") and m in out["pairs"]:
            out["pairs"][m]["closed_form_error"] = cf["error"]
        if m == "floor" and cf:
            out["methods"]["closed_form"] = _strip(cf)
    c = out["methods"].setdefault("closed_form", {"available": True})
    if cf_mem:
        c["memory"] = cf_mem
    if cf_times:
        c["median_over_pairs_s"] = statistics.median(cf_times)
        c.setdefault("median_s", statistics.median(cf_times))
    return out


def run_largest(case: dict, runner: Runner, progress) -> dict:
    out = {"cap_gib": runner.args.mem_cap_gb, "closed_form": [], "baselines": {}}
    largest = None
    for L, d, d_ff in case["sizes"]:
        n = _n(L, d, d_ff)
        progress(f"c: closed form at (L, d, d_ff) = ({L}, {d}, {d_ff}), n = {n:,} (fresh process, cap {runner.args.mem_cap_gb:g} GiB)")
        prob = _problem("hessian", L, d, d_ff)
        r = runner.run({"mode": "memory", "problem": prob, "methods": ["closed_form"]}, case["timeout_s"])
        e = r.get("methods", {}).get("closed_form", {})
        ok = r.get("status") == "ok" and "error" not in e and e.get("first_call_s") is not None
        out["closed_form"].append({"size": [L, d, d_ff], "n": n, "dense_gib": n * n * 8 / GiB, "ok": ok, "time_s": e.get("first_call_s"),
                                   "peak_rss_gib": (e.get("peak_rss_bytes") or 0) / GiB, "peak_delta_gib": (e.get("peak_delta_bytes") or 0) / GiB,
                                   "error": None if ok else (e.get("error") or r.get("error")), "watch": r.get("watch")})
        if not ok:
            break
        largest = (L, d, d_ff)
    out["largest"] = {"size": list(largest), "n": _n(*largest)} if largest else None
    # each baseline at the largest size the closed form managed (or the first one tried)
    L, d, d_ff = largest or case["sizes"][0]
    prob = _problem("hessian", L, d, d_ff)
    for m in case["baselines"]:
        if m in runner.disabled:
            out["baselines"][m] = {"size": [L, d, d_ff], "ok": None, "skip_reason": "disabled (treated as not installed)"}
            continue
        progress(f"c: {m} at (L, d, d_ff) = ({L}, {d}, {d_ff}), n = {_n(L, d, d_ff):,} (fresh process, cap {runner.args.mem_cap_gb:g} GiB)")
        r = runner.run({"mode": "memory", "problem": prob, "methods": [m]}, case["timeout_s"])
        e = r.get("methods", {}).get(m, {})
        ok = r.get("status") == "ok" and "error" not in e and e.get("first_call_s") is not None
        out["baselines"][m] = {"size": [L, d, d_ff], "n": _n(L, d, d_ff), "ok": ok if e.get("available", True) else None,
                               "skip_reason": e.get("skip_reason"), "time_s": e.get("first_call_s"),
                               "peak_rss_gib": (e.get("peak_rss_bytes") or 0) / GiB, "error": None if ok else (e.get("error") or r.get("error")),
                               "watch": r.get("watch")}
    return out


# ---------------------------------------------------------------------------------------
# summaries


def _med(e: dict | None):
    return None if not e else e.get("median_s")


def _ratio_kind(case: dict, m: str) -> tuple[float | None, str]:
    """Baseline ``m``'s median over the closed form's, and how it was measured: ``"same process"``;
    for a paired case whose closed form could not run again beside ``m`` (the baseline left its
    memory held), ``"other runs"``: ``m``'s warm median over the closed form's table median (timed
    beside the floor, else the median over its pairs), or else ``"first calls"``: the two first calls."""
    if case.get("layout") == "paired":
        pr = case.get("pairs", {}).get(m, {})
        if "ratio" in pr:
            return pr["ratio"], "same process"
        a, b = _med(case.get("methods", {}).get(m)), case.get("methods", {}).get("closed_form", {}).get("median_s")
        if a and b:
            return a / b, "other runs"
        return pr.get("ratio_first_calls"), "first calls" if "ratio_first_calls" in pr else "same process"
    ms = case.get("methods", {})
    a, b = _med(ms.get(m)), _med(ms.get("closed_form"))
    return (a / b if a and b else None), "same process"


def _ratio(case: dict, m: str):
    return _ratio_kind(case, m)[0]


RATIO_NOTE = {"other runs": "warm medians; the closed form's from another process (beside the floor, else over its pairs): it could not run again beside this one",
              "first calls": "ratio of first calls: the closed form could not run again beside this one"}


def _x(case: dict, m: str) -> str:
    """The ratio cell of ``m``, flagged when it was not measured within one process."""
    r, kind = _ratio_kind(case, m)
    return _fmt_x(r) + {"other runs": " (warm, other runs)", "first calls": " (first calls)"}.get(kind, "")


def _peak_delta(case: dict, m: str):
    mem = case.get("methods", {}).get(m, {}).get("memory") or {}
    return mem.get("peak_delta_bytes")


def evaluate_targets(results: dict) -> list[dict]:
    cases = {c["id"]: c for c in results["cases"]}
    t = []

    def add(name, value, ok, note=""):
        if results.get("quick"):  # small sizes: the numbers exercise the code, they do not test the targets
            ok, note = None, "quick run: not a test of the target" + (f"; {note}" if note else "")
        t.append({"target": name, "measured": value, "met": ok, "note": note})

    for of, goal in (("ln", 82), ("W_2", 445), ("W_1", 124)):
        c = cases.get(f"a/{of}/float32")
        if not c:
            continue
        r = _ratio(c, "autograd")
        rj = _ratio(c, "jacrev")
        add(f"{JAC_LABEL[of]}, float32, vs torch.autograd.functional.jacobian >= {goal}×",
            None if r is None else round(r, 1), None if r is None else r >= goal,
            "" if rj is None else f"vs torch.func.jacrev: {rj:.1f}×")
    big = next((c for c in results["cases"] if c["id"].startswith("b/mse/") and c.get("layout") == "paired"), None)
    if big:
        r = _ratio(big, "func_hessian")
        add(f"{big['id']}: >= 20× faster than torch.func.hessian", None if r is None else round(r, 2), None if r is None else r >= 20,
            big["methods"].get("func_hessian", {}).get("error") or "")
        r, kind = _ratio_kind(big, "jax")
        add(f"{big['id']}: >= 5× faster than jax.jit(jax.hessian)", None if r is None else round(r, 2), None if r is None else r >= 5,
            big["methods"].get("jax", {}).get("error") or big["methods"].get("jax", {}).get("skip_reason") or RATIO_NOTE.get(kind, ""))
        fl = big.get("pairs", {}).get("floor", {}).get("ratio")
        add(f"{big['id']}: within 3× of the floor (allocate + fill n×n)", None if not fl else round(1 / fl, 2),
            None if not fl else 1 / fl <= 3, "" if fl else big["methods"].get("floor", {}).get("error") or "")
    for cid, goal in (("b/mse/16x32x64", 3.0), ("b/mse/8x16x32", 1.0)):
        c = cases.get(cid)
        if not c:
            continue
        for m in ("func_hessian", "jax"):
            r = _ratio(c, m)
            label = f">= {goal:g}× faster than" if goal > 1 else "no slower than"
            add(f"{cid}: {label} {METHOD_LABEL[m]}", None if r is None else round(r, 2), None if r is None else r >= goal,
                c["methods"].get(m, {}).get("skip_reason") or "")
    for c in results["cases"]:
        if c["group"] != "b":
            continue
        pd = _peak_delta(c, "closed_form")
        ob = c.get("out_bytes")
        if pd and ob:
            add(f"{c['id']}: closed-form peak memory <= 1.5× the dense Hessian", round(pd / ob, 2), pd / ob <= 1.5,
                f"{_fmt_gib(pd)} for a {_fmt_gib(ob)} output")
    for c in results["cases"]:
        if c["group"] != "m":
            continue
        for m in MODEL_BASELINES:
            r, kind = _ratio_kind(c, m)
            e = c["methods"].get(m, {})
            add(f"{c['id']}: >= 5× faster than {METHOD_LABEL[m]}", None if r is None else round(r, 2), None if r is None else r >= 5,
                e.get("error") or e.get("skip_reason") or RATIO_NOTE.get(kind, ""))
        pd, ob = _peak_delta(c, "closed_form"), c.get("out_bytes")
        if pd and ob:
            add(f"{c['id']}: closed-form peak memory <= 1.5× the dense Hessian", round(pd / ob, 2), pd / ob <= 1.5,
                f"{_fmt_gib(pd)} for a {_fmt_gib(ob)} output")
    lc = cases.get("c/largest")
    if lc:
        fh = lc["baselines"].get("func_hessian", {})
        ok = bool(lc.get("largest")) and fh.get("ok") is False
        add("a size where torch.func.hessian runs out of memory and the closed form finishes",
            None if not lc.get("largest") else f"n = {lc['largest']['n']:,}: closed form ok, torch.func.hessian {'out of memory' if fh.get('ok') is False else 'ok' if fh.get('ok') else 'not run'}",
            ok if fh.get("ok") is not None else None)
    return t


def _fmt_t(s) -> str:
    if s is None:
        return "—"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.2f} ms" if s < 0.01 else f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def _fmt_spread(e: dict) -> str:
    """`` [p25–p75]``, or the number of timed samples when there are fewer than 3 (no spread to show)."""
    if not e or e.get("median_s") is None:
        return ""
    k = e.get("samples")
    if k is not None and k < 3:
        return f" ({k} sample{'s' if k > 1 else ''})"
    return f" [{_fmt_t(e.get('p25_s'))}–{_fmt_t(e.get('p75_s'))}]"


def _fmt_x(r) -> str:
    return "—" if r is None else (f"{r:.0f}×" if r >= 100 else f"{r:.1f}×" if r >= 1 else f"{r:.2f}×")


def _fmt_gib(b) -> str:
    return "—" if b is None else f"{b / GiB:.2f} GiB" if b >= 0.1 * GiB else f"{b / 2**20:.1f} MiB"


def _fmt_err(e: dict) -> str:
    v = e.get("rel_err")
    if v is None:
        v = e.get("sketch_rel_err")
        return "—" if v is None else f"{v:.1e} (sketch)"
    return f"{v:.1e}"


def _missing(e: dict) -> str | None:
    """Why a method entry has no time (``"skipped"``, ``"OOM"``, ``"timeout"``, ``"error"``), or None."""
    if not e.get("available", True) and e.get("skip_reason"):
        return "skipped"
    if e.get("error") and e.get("median_s") is None:
        return "OOM" if "out of memory" in str(e["error"]) else "timeout" if "timeout" in str(e["error"]) else "error"
    return None


def _cell(case, m) -> str:
    e = case["methods"].get(m, {})
    if why := _missing(e):
        return why
    if m == "closed_form" and case.get("layout") == "paired":
        beside_floor = case.get("pairs", {}).get("floor", {}).get("closed_form_median_s") == e.get("median_s")
        return _fmt_t(e.get("median_s")) + _fmt_spread(e) + (" (timed beside the floor)" if beside_floor else " (median over its pair runs)")
    return _fmt_t(e.get("median_s")) + _fmt_spread(e)


def _peak_cell(r: dict) -> str:
    """Peak RSS of a (c) job: the worker's own figure, or the watchdog's when the job was stopped."""
    if r.get("peak_rss_gib"):
        return f"{r['peak_rss_gib']:.1f} GiB"
    w = (r.get("watch") or {}).get("watched_max_rss_gib")
    return "—" if w is None else f"{w:.1f} GiB when it ended"


def _memory_table(w, cases: list[dict], peaked: list[str]) -> None:
    """The peak-memory table of ``cases`` for the methods ``peaked``, with each baseline's agreement."""
    w("Peak memory (increase during the first call, fresh process), and as a multiple of the dense output; agreement with the closed form:")
    w("")
    w("| case | dense output | " + " | ".join(METHOD_LABEL[m] for m in peaked) + " |")
    w("|---|---|" + "---|" * len(peaked))
    for c in cases:
        ob = c.get("out_bytes")
        cells = []
        for m in peaked:
            e = c["methods"].get(m, {})
            mem = e.get("memory") or {}
            pd = mem.get("peak_delta_bytes")
            if pd is not None and mem.get("status") == "ok":
                s = f"{_fmt_gib(pd)} ({pd / ob:.2f}×)" if ob else _fmt_gib(pd)
            elif mem.get("error"):
                s = "OOM" if "out of memory" in mem["error"] else mem["error"][:40]
            elif not e.get("available", True):
                s = "skipped"
            else:
                s = "—"
            if m != "closed_form":
                s += f"; err {_fmt_err(e)}"
            cells.append(s)
        w(f"| {c['id']} | {_fmt_gib(ob)} | " + " | ".join(cells) + " |")
    w("")


def markdown(results: dict) -> str:
    env = results["env"]
    L = []
    w = L.append
    w(f"Environment: {env['cpu_model']}, {env['logical_cpus']} logical CPUs, {env['memory_total_gib']} GiB RAM "
      f"({env['memory_available_gib_at_start']} GiB available at start, load average {env['load_average_at_start'][0]:.1f}); "
      f"torch {env['torch']} ({env['torch_threads']} threads{', on ' + env['cuda']['device'] if env.get('cuda') else ''}), jax {env['jax'] or 'not installed'}, "
      f"curvlinops {env['curvlinops'] or 'not installed'}; blockhess {env['blockhess_commit'] or '?'}; {env['date']}; "
      f"memory cap per job {env['mem_cap_gib']:g} GiB{'; QUICK run (small sizes)' if results.get('quick') else ''}.")
    w("")
    mem = ("the increase of the GPU memory allocated by torch (torch.cuda.max_memory_allocated)" if env.get("device") == "cuda"
           else "the increase of the process's resident memory")
    w("Times are medians of interleaved rounds after warm-up, [quartiles] beside them; a ratio is the baseline's median over "
      f"the closed form's, both measured in the same process (unless the cell says otherwise). Peak memory is {mem} "
      "during a method's first call in a fresh process. Errors are relative Frobenius errors against the closed form.")
    w("")
    acases = [c for c in results["cases"] if c["group"] == "a"]
    if acases:
        w("### (a) Component Jacobians at the paper's size (L, d, d_ff) = (8, 16, 32)")
        w("")
        w("| quantity | dtype | closed form | torch.autograd.functional.jacobian | × | jacrev | × | jacfwd | × | paper (CUDA, FP32): autograd / closed / × | max rel. err |")
        w("|---|---|---|---|---|---|---|---|---|---|---|")
        for c in acases:
            of, dt = c["problem"]["of"], c["problem"]["dtype"]
            pp = PAPER.get(of)
            paper = f"{pp['autograd_ms']} ms / {pp['closed_ms']} ms / {pp['speedup']:.0f}×" if pp else "—"
            errs = [c["methods"][m].get("rel_err") for m in ("autograd", "jacrev", "jacfwd") if c["methods"].get(m, {}).get("rel_err") is not None]
            err = f"{max(errs):.1e}" if errs else "—"
            w(f"| {JAC_LABEL[of]} | {dt} | {_cell(c, 'closed_form')} | {_cell(c, 'autograd')} | {_x(c, 'autograd')} | "
              f"{_cell(c, 'jacrev')} | {_x(c, 'jacrev')} | {_cell(c, 'jacfwd')} | {_x(c, 'jacfwd')} | {paper} | {err} |")
        w("")
        if any((e.get("memory") or {}).get("status") == "ok" for c in acases for e in c["methods"].values()):
            w("Peak memory (increase during the first call, fresh process):")
            w("")
            w("| quantity | dtype | dense output | " + " | ".join(METHOD_LABEL[m] for m in JAC_METHODS) + " |")
            w("|---|---|---|" + "---|" * len(JAC_METHODS))
            for c in acases:
                mems = [(c["methods"].get(m, {}).get("memory") or {}) for m in JAC_METHODS]
                cells = [_fmt_gib(mm.get("peak_delta_bytes")) if mm.get("status") == "ok" else "—" for mm in mems]
                w(f"| {JAC_LABEL[c['problem']['of']]} | {c['problem']['dtype']} | {_fmt_gib(c.get('out_bytes'))} | " + " | ".join(cells) + " |")
            w("")
    bcases = [c for c in results["cases"] if c["group"] == "b"]
    if bcases:
        w("### (b) Full loss Hessian, float64, dense n×n")
        w("")
        w("| case | n | closed form | floor | closed / floor | into a reused out= | fresh / out= | torch.func.hessian | × | jax.jit(hessian) (compile) | × | curvlinops H @ I | × | autograd.functional.hessian | × | issue's figures |")
        w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for c in bcases:
            p = c["problem"]
            key = (p["L"], p["d"], p["d_ff"])
            fl = _ratio(c, "floor")
            jx = c["methods"].get("jax", {})
            comp = f" ({_fmt_t(jx.get('compile_s'))})" if jx.get("compile_s") else ""
            mine = p["loss"] == "mse" and not p.get("heads")  # the issue measured the paper's block
            issue = "; ".join(f"{METHOD_LABEL[k].split(':')[0]} {v}" for k, v in ISSUE_HESSIAN.get(key, {}).items()) if mine else ""
            ro = _ratio(c, "closed_form_out")
            w(f"| {c['id']} | {format(c['n'], ',') if c.get('n') else '—'} | {_cell(c, 'closed_form')} | {_cell(c, 'floor')} | {_fmt_x(None if not fl else 1 / fl)} | "
              f"{_cell(c, 'closed_form_out')} | {_fmt_x(None if not ro else 1 / ro)} | "
              f"{_cell(c, 'func_hessian')} | {_x(c, 'func_hessian')} | {_cell(c, 'jax')}{comp} | {_x(c, 'jax')} | "
              f"{_cell(c, 'curvlinops')} | {_x(c, 'curvlinops')} | {_cell(c, 'autograd')} | {_x(c, 'autograd')} | {issue} |")
        w("")
        _memory_table(w, bcases, [m for m in HESS_METHODS if m not in NO_PEAK])
    mcases = [c for c in results["cases"] if c["group"] == "m"]
    if mcases:
        w("### (m) Whole-model Hessians, float64, dense n×n, cross-entropy")
        w("")
        w("| case | model | B | n | closed form | floor | torch.func.hessian | × | curvlinops H @ I (column blocks) | × |")
        w("|---|---|---|---|---|---|---|---|---|---|")
        for c in mcases:
            p = c["problem"]
            model = (f"digits ViT, {p['blocks']} block{'s' if p['blocks'] > 1 else ''}" if p["model"] == "vit" else
                     f"GPT-2, {p['blocks']} layer{'s' if p['blocks'] > 1 else ''}, d = {p['d']}, {p['heads']} heads, vocabulary {p['vocab']}, {p['positions']} positions")
            cols = c["methods"].get("curvlinops", {}).get("columns")
            w(f"| {c['id']} | {model} | {p['B']} | {format(c['n'], ',') if c.get('n') else '—'} | {_cell(c, 'closed_form')} | {_cell(c, 'floor')} | "
              f"{_cell(c, 'func_hessian')} | {_x(c, 'func_hessian')} | {_cell(c, 'curvlinops')}{f' ({cols:,} columns)' if cols else ''} | "
              f"{_x(c, 'curvlinops')} |")
        w("")
        _memory_table(w, mcases, [m for m in MODEL_METHODS if m not in NO_PEAK])
    lc = next((c for c in results["cases"] if c["group"] == "c"), None)
    if lc:
        w(f"### (c) Largest full Hessian within {lc['cap_gib']:g} GiB")
        w("")
        w("| method | (L, d, d_ff) | n | dense | result | time | peak RSS | cap for the job |")
        w("|---|---|---|---|---|---|---|---|")
        for r in lc["closed_form"]:
            res = "ok" if r["ok"] else (r["error"] or "failed")[:80]
            w(f"| closed form | {tuple(r['size'])} | {r['n']:,} | {r['dense_gib']:.1f} GiB | {res} | {_fmt_t(r['time_s'])} | {_peak_cell(r)} | {(r.get('watch') or {}).get('cap_gib', '—')} GiB |")
        for m, r in lc["baselines"].items():
            res = "skipped: " + r["skip_reason"] if r.get("skip_reason") else "ok" if r.get("ok") else (r.get("error") or "failed")[:80]
            w(f"| {METHOD_LABEL[m]} | {tuple(r['size'])} | {r.get('n', 0):,} | {r.get('n', 0) ** 2 * 8 / GiB:.1f} GiB | {res} | {_fmt_t(r.get('time_s'))} | {_peak_cell(r)} | {(r.get('watch') or {}).get('cap_gib', '—')} GiB |")
        w("")
    w("### Targets")
    w("")
    w("| target | measured | met |")
    w("|---|---|---|")
    for t in results["targets"]:
        met = "yes" if t["met"] else "no" if t["met"] is False else "n/a" if results.get("quick") else "not measured"
        note = f" ({t['note']})" if t.get("note") else ""
        w(f"| {t['target']} | {t['measured'] if t['measured'] is not None else '—'}{note} | {met} |")
    w("")
    return "\n".join(L)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [("a", "Component Jacobians, (8, 16, 32)", JAC_METHODS), ("b", "Full loss Hessian, float64", HESS_METHODS),
              ("m", "Whole-model Hessian, float64", MODEL_METHODS)]
    groups = [(g, t, ms) for g, t, ms in groups if any(c["group"] == g for c in results["cases"])]
    if not groups:
        return
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 4.2 * len(groups)), squeeze=False)
    for ax, (g, title, ms) in zip(axes[:, 0], groups):
        cases = [c for c in results["cases"] if c["group"] == g]
        width = 0.8 / len(ms)
        gaps = []  # (x, why) of a method that ran out of memory, timed out, failed or was skipped
        for j, m in enumerate(ms):
            xs, ys = [], []
            for i, c in enumerate(cases):
                e = c["methods"].get(m, {})
                x = i + (j - (len(ms) - 1) / 2) * width
                if e.get("median_s"):
                    xs.append(x)
                    ys.append(e["median_s"])
                elif e and (why := _missing(e)):
                    gaps.append((x, why))
            ax.bar(xs, ys, width, label=METHOD_LABEL[m])
        ax.set_yscale("log")
        for x, why in gaps:  # at the foot of the axis, where the bar would start
            ax.text(x, 0.02, why, rotation=90, ha="center", va="bottom", fontsize=6, color="0.3",
                    transform=ax.get_xaxis_transform())
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([c["id"].split("/", 1)[1] for c in cases], rotation=20, fontsize=8)
        ax.set_ylabel("median time (s)")
        ax.set_title(title)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes, off the bars
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------


def _choose_threads(args) -> None:
    import torch

    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0]
    if args.threads is not None:
        args.effective_threads, args.threads_reason = args.threads, "--threads"
    elif load >= cpus and cpus > 1:
        args.effective_threads = 1
        args.threads_reason = (f"auto: load average {load:.1f} >= {cpus} CPUs at start (shared machine); multi-threaded "
                               "OpenMP runs stall there, so every method runs single-threaded")
    else:
        args.effective_threads, args.threads_reason = torch.get_num_threads(), "torch default"


def run(args) -> int:
    if args.mem_cap_gb <= 0:
        raise ValueError(f"--mem-cap-gb must be positive, got {args.mem_cap_gb}")
    if args.threads is not None and not (isinstance(args.threads, int) and args.threads >= 1):
        raise ValueError(f"--threads must be auto or an integer >= 1, got {args.threads!r}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    plan = build_plan(args)
    _choose_threads(args)
    check_out(args.out)  # written as it goes (a long run keeps its finished cases), so never into a folder of other files
    try:
        os.makedirs(args.out, exist_ok=True)
        (Path(args.out) / MARKER).write_text("results of blockhess bench\n")
    except OSError as exc:  # the wording of check_out's
        raise OSError(f"cannot write to --out {Path(args.out).resolve()}: {exc.strerror or exc}") from None
    results = {"quick": args.quick, "env": {**environment(args.device), **_settings(args)}, "cases": []}
    t_start = time.perf_counter()

    def progress(msg):
        if not args.quiet:
            print(f"[bench {time.perf_counter() - t_start:6.0f}s] {msg}", file=sys.stderr, flush=True)

    def save():
        results["targets"] = evaluate_targets(results)
        results["total_s"] = round(time.perf_counter() - t_start, 1)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)

    with tempfile.TemporaryDirectory(prefix="blockhess-bench-") as wd:
        runner = Runner(args, wd)
        for case in plan:
            body = {"interleaved": run_interleaved, "paired": run_paired, "largest": run_largest}[case["layout"]](case, runner, progress)
            entry = {k: v for k, v in case.items() if k not in ("time",)}
            entry.update(body)
            results["cases"].append(entry)
            save()
    results["env"]["load_average_at_end"] = load_average()
    save()
    md = markdown(results)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write("# blockhess bench\n\n" + md)
    plot(results, os.path.join(args.out, "bench.png"))
    progress(f"wrote {os.path.join(args.out, 'bench.json')}, bench.md, bench.png")
    if not args.quiet:
        print(md)
    return 0
