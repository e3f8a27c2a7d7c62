"""The timing and memory harness the product benchmarks share (``model_products.py``, ``lockstep.py``,
``llama.py``): methods timed in interleaved rounds after a warm-up, the order rotated each round, each
method's first result kept for the accuracy check; and each method's peak resident memory over its set-up
and first call, in a fresh worker process of the calling script.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from blockhess_lab.bench_worker import peak_bytes, reset_peak, rss_bytes


def rounds(calls: dict, n_rounds: int, warmup: int, log, keep=lambda m, out: out) -> tuple[dict, dict]:
    """``calls`` (method -> a zero-argument callable) run ``warmup + n_rounds`` times, round ``r`` in the
    order rotated by ``r``. Returns ``(times, first)``: each method's seconds after the warm-up, and
    ``keep(method, output)`` of its first call (``None`` drops it). ``log`` gets a line per round."""
    methods = tuple(calls)
    times = {m: [] for m in methods}
    first = {}
    for r in range(warmup + n_rounds):
        for m in methods[r % len(methods):] + methods[: r % len(methods)]:
            t = time.perf_counter()
            out = calls[m]()
            dt = time.perf_counter() - t
            if r >= warmup:
                times[m].append(dt)
            if r == 0:
                kept = keep(m, out)
                if kept is not None:
                    first[m] = kept
            del out
        log(f"round {r}: " + ", ".join(f"{m} {times[m][-1]:.3f} s" for m in methods) if r >= warmup
            else f"warm-up {r} done")
    return times, first


def peak_of_first_call(make_call) -> dict:
    """In a worker process: the resident memory once the problem is built, and the peak above it over
    ``make_call()`` (the method's set-up) and the call it returns."""
    res = {"rss_built_bytes": rss_bytes()}
    reset_peak()
    out = make_call()()
    res["peak_total_bytes"] = peak_bytes() - res["rss_built_bytes"]
    del out
    return res


def peaks_in_fresh_processes(script: str, methods, flags: list[str], log) -> dict:
    """``python script --worker m *flags --out -`` for each method ``m``: the JSON line it prints last
    (:func:`peak_of_first_call`), or the worker's error."""
    out = {}
    for m in methods:
        r = subprocess.run([sys.executable, script, "--worker", m, *flags, "--out", "-"], capture_output=True, text=True)
        out[m] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-2000:]}
        log(f"memory {m}: " + (f"{out[m]['peak_total_bytes'] / 2**30:.2f} GiB" if "peak_total_bytes" in out[m]
                               else out[m]["error"][-300:]))
    return out
