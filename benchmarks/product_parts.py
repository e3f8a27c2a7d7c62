"""``python benchmarks/product_parts.py [--parts ...] --out FILE``: the five measurements a whole-model product's
choices rest on (docs/results.md, "A pooled output", "Aligned logit rows", "oneDNN for the token products"),
one thread, float32, medians of rounds that interleave the two forms compared, after one warm-up:

* ``rows``: one direction's weight rows ``xᵀġ + ẋᵀg`` ``(d_in, d_out)`` from ``T`` token rows, as one product
  over the tokens stacked twice (``[x; ẋ]ᵀ[ġ; g]``, the two concatenations included) against two products
  into one result (``mm`` then ``addmm_``), written into an output already written once, at GPT-2 small's
  weight shapes (``768 × 768``, ``768 × 3072``, ``3072 × 768``, the tied head's ``50257 × 768``):
  ``blockhess.model.stages.HEAD_STACK_MAX_ROWS`` is the head's crossover.
* ``logits``: the head's logit tangent ``ḣ W_Eᵀ + h Ẇ_Eᵀ`` ``(T, V)`` (``mm`` then ``addmm_``, ``d = 768``) into
  rows of ``V`` entries against into :func:`blockhess.heap.aligned_rows`' (rows on cache lines), both
  written once before, at GPT-2's ``V = 50,257`` and Llama's ``32,000`` (already aligned: the control), and
  once in float64.
* ``through``: the head's pass for tangents with no direction of its own (``SoftmaxHead.through``' loop:
  ``ḣ W`` a column chunk at a time, scaled, multiplied back by ``Wᵀ``) at ``R`` token rows, by torch's ``mm``
  (the pass's products before ``blockhess.gemm``), in chunks of the width ``THROUGH_CHUNK_BYTES`` gives
  against that width cut to whole cache lines (what the pass does).
* ``gemm``: token rows by a weight, ``x W`` and ``c + x W`` (``T`` rows), by torch's ``mm``/``addmm_`` (MKL
  on this build; results in :func:`blockhess.heap.aligned_rows`, as the head's were) against
  :mod:`blockhess.gemm`'s (oneDNN), at GPT-2 small's weights as the passes hold them
  (``768 × 768``, ``768 × 3072``, ``3072 × 768`` contiguous; the tied head's ``W_Eᵀ`` as a view of ``W_E`` and
  ``W_E`` itself): seconds and GMAC/s.
* ``output``: writing a 124,439,808-entry float32 vector (GPT-2 small's ``n``) into a fresh ``torch.empty``
  against into the memory :class:`blockhess.heap.OutputPool` hands back: the seconds and the minor page
  faults (``getrusage``) of each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import torch  # noqa: E402

import interleaved  # noqa: E402  (benchmarks/, the script's own folder)
from blockhess import gemm, heap  # noqa: E402
from blockhess_lab.runtime import environment, git_commit, load_average  # noqa: E402

SHAPES = ((768, 768), (768, 3072), (3072, 768), (50257, 768))
PARTS = ("rows", "logits", "through", "gemm", "output")


def medians(calls: dict, repeats: int) -> dict:
    """Each call's median seconds over ``repeats`` interleaved rounds after one warm-up (the harness of the
    product benchmarks, :func:`interleaved.rounds`)."""
    times, _ = interleaved.rounds(calls, repeats, 1, lambda msg: None, keep=lambda m, out: None)
    return {m: statistics.median(t) for m, t in times.items()}


def rows(tokens, repeats: int, log) -> list:
    out = []
    gen = torch.Generator().manual_seed(0)
    for T in tokens:
        for d_in, d_out in SHAPES:
            x, dx = torch.randn(T, d_in, generator=gen), torch.randn(T, d_in, generator=gen)
            g, dg = torch.randn(T, d_out, generator=gen), torch.randn(T, d_out, generator=gen)
            res = torch.zeros(d_in, d_out)

            def stacked():
                torch.mm(torch.cat([x, dx]).T, torch.cat([dg, g]), out=res)

            def two():
                torch.mm(x.T, dg, out=res).addmm_(dx.T, g)

            t = medians({"stacked": stacked, "two": two}, repeats)
            a, b = t["stacked"], t["two"]
            out.append({"tokens": T, "d_in": d_in, "d_out": d_out, "stacked_s": a, "two_products_s": b,
                        "stacked_over_two": a / b})
            log(f"rows T={T} {d_in}x{d_out}: stacked {a * 1e3:.2f} ms, two {b * 1e3:.2f} ms")
    return out


def logits(tokens, repeats: int, log, d: int = 768) -> list:
    out = []
    gen = torch.Generator().manual_seed(0)
    cases = [(T, V, torch.float32) for V in (50257, 32000) for T in tokens] + [(128, 50257, torch.float64)]
    for T, V, dtype in cases:
        W, dW = torch.randn(V, d, generator=gen, dtype=dtype), torch.randn(V, d, generator=gen, dtype=dtype)
        h, dh = torch.randn(T, d, generator=gen, dtype=dtype), torch.randn(T, d, generator=gen, dtype=dtype)
        outs = {"plain": torch.zeros(T, V, dtype=dtype), "aligned": heap.aligned_rows((T, V), h).zero_()}
        res = medians({name: lambda z=z: torch.mm(dh, W.T, out=z).addmm_(h, dW.T) for name, z in outs.items()},
                      repeats)
        out.append({"tokens": T, "vocab": V, "dtype": str(dtype).removeprefix("torch."), "plain_s": res["plain"],
                    "aligned_s": res["aligned"], "plain_over_aligned": res["plain"] / res["aligned"]})
        log(f"logits T={T} V={V} {dtype}: plain {res['plain'] * 1e3:.1f} ms, aligned {res['aligned'] * 1e3:.1f} ms")
    return out


def through(counts, repeats: int, log, d: int = 768, V: int = 50257) -> list:
    from blockhess.model.stages import THROUGH_CHUNK_BYTES

    out = []
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(V, d, generator=gen).T
    line = heap.ROW_ALIGN_BYTES // 4
    for R in counts:
        x, p, acc = torch.randn(R, d, generator=gen), torch.rand(R, V, generator=gen), torch.zeros(R, d)
        raw = max(256, min(V, THROUGH_CHUNK_BYTES // (R * 4)))
        widths = {"raw": raw, "cut": raw - raw % line if raw < V else raw}

        def chunked(step):
            buf = None
            for c0 in range(0, V, step):
                c1 = min(V, c0 + step)
                buf = torch.mm(x, W[:, c0:c1], out=buf if buf is not None and buf.shape[1] == c1 - c0 else None)
                acc.addmm_(buf.mul_(p[:, c0:c1]), W[:, c0:c1].T)

        res = medians({name: lambda w=w: chunked(w) for name, w in widths.items()}, repeats)
        out.append({"rows": R, "raw_width": widths["raw"], "cut_width": widths["cut"], "raw_s": res["raw"],
                    "cut_s": res["cut"], "raw_over_cut": res["raw"] / res["cut"]})
        log(f"through R={R}: width {widths['raw']} {res['raw']:.3f} s, width {widths['cut']} {res['cut']:.3f} s")
    return out


def token_products(tokens, repeats: int, log, d: int = 768, V: int = 50257) -> list:
    out = []
    gen = torch.Generator().manual_seed(0)
    W_E = torch.randn(V, d, generator=gen)
    weights = [("W", torch.randn(a, b, generator=gen)) for a, b in SHAPES[:3]] + [("W_E^T", W_E.T), ("W_E", W_E)]
    for T in tokens:
        for name, W in weights:
            x = torch.randn(T, W.shape[0], generator=gen)
            c = heap.aligned_rows((T, W.shape[1]), x).copy_(torch.randn(T, W.shape[1], generator=gen))
            # torch's products as the passes ran them before blockhess.gemm: rows on cache lines
            calls = {"mm_mkl": lambda: torch.mm(x, W, out=heap.aligned_rows((T, W.shape[1]), x)),
                     "mm_onednn": lambda: gemm.mm(x, W),
                     "addmm_mkl": lambda: c.addmm_(x, W), "addmm_onednn": lambda: gemm.addmm(c, x, W)}
            res = medians(calls, repeats)
            gmac = T * W.shape[0] * W.shape[1] / 1e9
            out.append({"tokens": T, "weight": name, "d_in": W.shape[0], "d_out": W.shape[1], "gmac": gmac,
                        **{f"{m}_s": t for m, t in res.items()}, **{f"{m}_gmac_per_s": gmac / t for m, t in res.items()}})
            log(f"gemm T={T} {name} {tuple(W.shape)}: " + ", ".join(f"{m} {gmac / t:.1f} GMAC/s" for m, t in res.items()))
    return out


def output(n: int, repeats: int, log) -> dict:
    pool = heap.OutputPool()

    def fresh():
        torch.empty(n).fill_(1.0)

    def pooled():
        pool.empty(n, torch.float32, torch.device("cpu")).fill_(1.0)  # dropped at once: back to the pool

    res = {"entries": n}
    for name, f in (("fresh", fresh), ("pooled", pooled)):
        f()
        times, faults = [], []
        for _ in range(repeats):
            r0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
        res[name] = {"median_s": statistics.median(times), "seconds": times, "minor_faults": faults}
        log(f"output {name}: {res[name]['median_s']:.3f} s, {statistics.median(faults):.0f} faults")
    return res


def _ints(text: str) -> list:
    return [int(t) for t in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="16,32,48,64,96,128,256,1024", help="token row counts (comma-separated)")
    p.add_argument("--logit-tokens", default="32,128,1024", help="token counts of the logit tangent (comma-separated)")
    p.add_argument("--through-rows", default="128,3072", help="token rows of the head's pass (comma-separated)")
    p.add_argument("--entries", type=int, default=124_439_808, help="the output's entries (default GPT-2 small's n)")
    p.add_argument("--gemm-tokens", default="32,128,1024", help="token rows of the gemm part (comma-separated)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)} (default: all)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    rep = {"benchmark": "product_parts", "commit": git_commit(), "environment": environment(), "settings": vars(args),
           "load_average_at_start": load_average()}
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        raise SystemExit(f"--parts: a subset of {','.join(PARTS)}")
    if "rows" in parts:
        rep["rows"] = rows(_ints(args.tokens), args.repeats, log)
    if "logits" in parts:
        rep["logits"] = logits(_ints(args.logit_tokens), args.repeats, log)
    if "through" in parts:
        rep["through"] = through(_ints(args.through_rows), max(3, args.repeats // 3), log)
    if "gemm" in parts:
        rep["gemm"] = token_products(_ints(args.gemm_tokens), args.repeats, log)
    if "output" in parts:
        rep["output"] = output(args.entries, args.repeats, log)
    rep["load_average_at_end"] = load_average()
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
