"""``python benchmarks/threads.py``: the closed form's intra-op threads, measured (docs/results.md, "Threads").

Sections, each in the JSON (``--out``):

* ``shift``: from stored bench runs (``benchmarks/results/run*.json``), the rounds of the
  (8, 16, 32) Hessian jobs where the closed form took its slow time (> 9.2 ms) against the
  others, and each method's median in both.
* ``regions``: OpenMP parallel regions per call on 2 threads (``GOMP_parallel``, counted by
  ``benchmarks/gompcount.c``, compiled with ``cc`` and preloaded: the script re-executes itself),
  for the base commit's package (``--base``, exported with ``git archive``) and this checkout's,
  and for the baselines at n = 1,792.
* ``faults``: minor page faults (``ru_minflt``) and time per call of the fresh closed form at
  n = 1,792, ``torch.func.hessian`` interleaved as in the bench's rounds.
* ``ab``: wall-clock times, base against this checkout on 1 and 2 threads, interleaved in
  rotated order in one process, next to one busy process (``--busy``: ``while True: pass``,
  started here and killed at the end; ``--busy-cpu``: pinned to one CPU) or not; a variant whose sample passes ``--cap`` seconds
  is not timed again.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import resource
import shutil
import statistics as st
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

CASES = ("n1792", "n1792_fresh", "ce1792", "jacobian", "readme_full", "readme", "norms", "n7168")


def _shim():
    """Re-execute under LD_PRELOAD of the region counter (once); True if it is loaded."""
    if os.environ.get("BLOCKHESS_GOMPCOUNT") == "1":
        return True
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    so = os.path.join(tempfile.mkdtemp(prefix="gompcount"), "gompcount.so")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", so, os.path.join(HERE, "gompcount.c"), "-ldl"], check=True)
    env = dict(os.environ, LD_PRELOAD=so, BLOCKHESS_GOMPCOUNT="1")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


class Regions:
    def __init__(self):
        lib = ctypes.CDLL(None)
        try:
            self.calls, self.reset = lib.gomp_calls, lib.gomp_reset
            self.calls.restype = ctypes.c_long
            self.ok = True
        except AttributeError:
            self.ok = False

    def count(self, f) -> int | None:
        if not self.ok:
            return None
        self.reset()
        f()
        return int(self.calls())


def base_package(commit: str) -> str:
    """The package at ``commit``, importable as ``blockhess_base`` from the returned folder."""
    d = tempfile.mkdtemp(prefix="blockhess_base")
    tar = subprocess.run(["git", "-C", ROOT, "archive", commit, "src/blockhess"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", d], input=tar, check=True)
    os.rename(os.path.join(d, "src", "blockhess"), os.path.join(d, "blockhess_base"))
    return d


def build(bh, name: str, bufs: dict):
    """A call of ``bh`` for case ``name``."""
    import torch

    g = torch.Generator().manual_seed(0)
    if name in ("readme", "readme_full", "norms"):  # README's first snippet
        cfg = bh.BlockConfig(d_model=16, d_ff=32, ln_eps=1e-5)
        p = bh.init_params(cfg, seed=0)
        X, T = (torch.randn(8, 16, 16, dtype=torch.float64, generator=g) for _ in range(2))
        if name == "readme_full":
            return lambda: bh.hessian(p, X, cfg, loss="mse", target=T).dense()
        if name == "readme":
            def call():
                H = bh.hessian(p, X, cfg, loss="mse", target=T)
                H.dense(), H.outer.dense(), H.functional.dense()
            return call
        H = bh.hessian(p, X, cfg, loss="mse", target=T)
        return lambda: bh.bounds.exact_norms(H)
    L, d, dff = (16, 32, 64) if name == "n7168" else (8, 16, 32)  # the bench's b/*/8x16x32 and b/mse/16x32x64
    cfg = bh.BlockConfig(d_model=d, d_ff=dff, d_k=d)
    p = bh.init_params(cfg, seed=0)
    X = torch.randn(L, d, dtype=torch.float64, generator=g)
    if name == "jacobian":
        return lambda: bh.jacobian(p, X, cfg)
    T = torch.randint(0, d, (L,), generator=g) if name == "ce1792" else torch.randn(L, d, dtype=torch.float64, generator=g)
    n = sum(v.numel() for v in p.values())
    out = None if name == "n1792_fresh" else bufs.setdefault(n, torch.empty(n, n, dtype=torch.float64))
    loss = "ce" if name == "ce1792" else "mse"
    return lambda: bh.hessian(p, X, cfg, loss=loss, target=T, out=out).dense()


def shift() -> list[dict]:
    rows = []
    for f in sorted(glob.glob(os.path.join(HERE, "results", "run*.json"))):
        try:
            d = json.load(open(f))
        except (OSError, ValueError):
            continue
        for c in d.get("cases", []):
            if c.get("id") not in ("b/mse/8x16x32", "b/ce/8x16x32"):
                continue
            ms = c["methods"]
            cf = ms.get("closed_form", {}).get("times")
            if not cf:
                continue
            slow = [t > 0.0092 for t in cf]
            if all(slow) or not any(slow):
                continue
            row = {"run": os.path.basename(f), "case": c["id"], "slow_rounds": sum(slow), "rounds": len(cf), "methods": {}}
            for m, v in ms.items():
                t = v.get("times")
                if t and len(t) == len(cf):
                    fast_t = [x for x, s in zip(t, slow) if not s]
                    slow_t = [x for x, s in zip(t, slow) if s]
                    row["methods"][m] = {"fast_ms": 1e3 * st.median(fast_t), "slow_ms": 1e3 * st.median(slow_t)}
            rows.append(row)
    return rows


def faults(bh) -> dict:
    import torch

    from blockhess_lab import bench_worker as bw

    P = bw.Problem(dict(kind="hessian", L=8, d=16, d_ff=32, B=0, dtype="float64", loss="mse", seed=0))
    fs = {m: bw.METHODS[m](P)[0] for m in ("closed_form", "closed_form_out", "floor", "func_hessian")}
    for f in fs.values():
        f(), f()
    res = {m: {"ms": [], "faults": []} for m in fs}
    for _ in range(6):
        for m, f in fs.items():
            k = 1 if m == "func_hessian" else 5
            r0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            for _ in range(k):
                f()
            res[m]["ms"].append(1e3 * (time.perf_counter() - t) / k)
            res[m]["faults"].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / k)
    return {"threads": torch.get_num_threads(), "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            **{m: {"median_ms": st.median(v["ms"]), "faults_per_call": st.median(v["faults"])} for m, v in res.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="1f065b8", help="commit of the package to compare with (default: before blockhess.threads)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="time next to one busy process")
    ap.add_argument("--busy-cpu", type=int, default=None, help="pin the busy process to this CPU (os.sched_setaffinity)")
    ap.add_argument("--cap", type=float, default=20.0, help="seconds; a variant with a slower sample is not timed again")
    ap.add_argument("--sections", default="shift,regions,faults,ab")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    have_shim = _shim() if "regions" in sections else False

    import torch

    sys.path.insert(0, base_package(args.base))
    import blockhess as new
    import blockhess_base as old

    impls = {"base": old, "current": new}
    cases = args.cases.split(",")
    result = {"base": args.base, "torch": torch.__version__, "default_threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "load_at_start": os.getloadavg(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if "shift" in sections:
        result["shift"] = shift()
    bufs: dict = {}
    if "regions" in sections:
        reg, counts = Regions(), {}
        torch.set_num_threads(2)
        for c in cases:
            for i, bh in impls.items():
                f = build(bh, c, bufs)
                f()
                counts[f"{c}/{i}"] = reg.count(f)
        from blockhess_lab import bench_worker as bw

        P = bw.Problem(dict(kind="hessian", L=8, d=16, d_ff=32, B=0, dtype="float64", loss="mse", seed=0))
        for m in ("func_hessian", "autograd"):
            f = bw.METHODS[m](P)[0]
            f()
            counts[f"n1792/{m}"] = reg.count(f)
        result["regions"] = counts if have_shim else "no counter (needs cc and libgomp)"
        print("regions per call on 2 threads:", json.dumps(counts, indent=1), flush=True)
    if "faults" in sections:
        torch.set_num_threads(1)
        result["faults"] = faults(new)
        print("faults:", json.dumps(result["faults"], indent=1), flush=True)
    if "ab" in sections:
        variants = [(i, k) for i in impls for k in (1, 2)]
        fs = {(c, i): build(bh, c, bufs) for c in cases for i, bh in impls.items()}
        torch.set_num_threads(1)
        for f in fs.values():
            f()
        pin = "" if args.busy_cpu is None else f"import os\nos.sched_setaffinity(0, {{{args.busy_cpu}}})\n"
        busy = subprocess.Popen([sys.executable, "-c", pin + "while True: pass"]) if args.busy else None
        time.sleep(0.2)
        if busy is not None and busy.poll() is not None:
            raise RuntimeError("the busy process did not start")
        times: dict = {}
        try:
            time.sleep(0.5)
            for r in range(args.rounds):
                for c in cases:
                    for i, k in variants[r % 4:] + variants[: r % 4]:
                        key = f"{c}/{i}/{k}"
                        if times.get(key) and max(times[key]) > args.cap:
                            continue
                        torch.set_num_threads(k)
                        t = time.perf_counter()
                        fs[(c, i)]()
                        times.setdefault(key, []).append(time.perf_counter() - t)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        result["ab"] = {"busy_process": args.busy, "busy_cpu": args.busy_cpu, "rounds": args.rounds, "load_at_end": os.getloadavg(),
                        "times_s": times,
                        "median_ms": {k: 1e3 * st.median(v) for k, v in times.items()},
                        "min_ms": {k: 1e3 * min(v) for k, v in times.items()}}
        for c in cases:
            print(c, " | ".join(f"{i} {k}t {result['ab']['median_ms'][f'{c}/{i}/{k}']:.1f} ms" for i, k in variants
                                if f"{c}/{i}/{k}" in times), flush=True)
    torch.set_num_threads(result["default_threads"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
