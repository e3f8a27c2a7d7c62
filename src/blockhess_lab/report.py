r"""``blockhess report``: the exact Hessian of a trained Transformer block, checked against autograd.

On a fixed batch of training images of the digits ViT (:mod:`~blockhess_lab.vit`),
at initialisation and at the trained weights:

1. the exact Hessian of the model's mean cross-entropy w.r.t. the block's weights
   ``W_Q, W_K, W_V, W_1, W_2`` by the closed form, :func:`blockhess.hessian` with the pooling
   and head as the loss ``ℓ(Z)`` (``vit.head_loss``) and the embedded patches as the input ``X``,
   plus its outer (Gauss–Newton) and functional parts (paper eq. 10);
2. the same three matrices by :func:`blockhess.reference.hessian` (``torch.func``) in float64 on
   the same batch, and the relative error of every block;
3. per block pair, Frobenius and spectral norms of the full, outer and functional parts;
   eigenvalues of the full Hessian (extremes, how many negative), of its diagonal blocks and
   of the two parts;
4. timings of both methods in this run; figures; ``report.json`` and ``report.md``.

Everything is written into a temporary folder next to ``--out`` and moved into place only
when complete, so a failed run leaves no partial report (and an older report intact).
Exit status: 0; 1 when the report is written but ``validation.max_rel_error`` exceeds the
tolerance (1e-10 in float64, 1e-4 for a float32 closed form); 2 with one line on stderr for
bad input (missing/corrupt checkpoint, unwritable ``--out``, a batch larger than the data).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import torch

from blockhess.result import pairs
from blockhess.config import SHORT_NAMES
from blockhess.hessian import hessian as closed_form_hessian
from blockhess import linalg, reference
from blockhess.linalg import rel_error
from . import plots
from . import vit as vitmod
from .outputs import atomic_dir, out_help, write_json
from .runtime import add_quiet_argument, add_threads_argument, environment, load_average, progress, torch_threads

HELP = "exact Hessian of a trained digits-ViT block: closed form vs autograd, norms, spectra, figures"

_DTYPES = {"float64": torch.float64, "float32": torch.float32}
_PARTS = ("full", "outer", "functional")
#: figure labels of the weights: the one table's names, the FFN's with their W (W1, not 1)
_LABELS = {n: f"W{s}" if s.isdigit() else s for n, s in SHORT_NAMES.items()}
_TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="report", metavar="DIR",
                   help=out_help("report", "report.json, report.md, PNG figures"))
    p.add_argument("--checkpoint", default=None, metavar="PATH",
                   help=f"model checkpoint to read; a path given here must exist (default: {vitmod.DEFAULT_CHECKPOINT} under the "
                        "current folder, with _seed{S}/_steps{N} added for other --seed/--steps; trained and saved there when absent)")
    p.add_argument("--batch", type=int, default=128, metavar="N",
                   help="number of training images in the fixed batch (default: 128)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="float64",
                   help="dtype of the closed form; the autograd reference is always float64 (default: float64)")
    p.add_argument("--seed", type=int, default=0, metavar="SEED",
                   help="seed of the batch choice and, when training, of the model (default: 0)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help=f"training steps of the model (its own default checkpoint; not with --checkpoint) (default: {vitmod.DEFAULT_STEPS})")
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="timed runs of the closed form; the median is reported (default: 3)")
    add_threads_argument(p)
    add_quiet_argument(p)
    p.add_argument("--ref-chunk", type=int, default=4, help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- numbers


def _offsets(sizes) -> list[int]:
    off = [0]
    for s in sizes:
        off.append(off[-1] + s)
    return off


def _block(D: torch.Tensor, names, off, a, b) -> torch.Tensor:
    i, j = names.index(a), names.index(b)
    return D[off[i] : off[i + 1], off[j] : off[j + 1]]


def _eig_summary(lam: torch.Tensor, eps: float) -> dict:
    lam = lam.to(torch.float64)
    n = lam.numel()
    big = float(lam.abs().max())
    tol = n * eps * big
    return {
        "n": n,
        "min": float(lam.min()),
        "max": float(lam.max()),
        "max_abs": big,
        "n_negative": int((lam < -tol).sum()),
        "n_positive": int((lam > tol).sum()),
        "n_near_zero": int((lam.abs() <= tol).sum()),
        "negative_tolerance": tol,
        "sum_negative": float(lam[lam < -tol].sum()),
        "sum_positive": float(lam[lam > tol].sum()),
    }


def _load(averages: list[float] | None) -> str:
    """The 1-minute figure of :func:`~blockhess_lab.runtime.load_average`'s list, or "n/a"."""
    return "n/a" if averages is None else f"{averages[0]:.2f}"


def _time_closed_form(params, X, cfg, loss, y, repeats: int):
    """The closed form ``repeats`` times (wall and CPU seconds of each run), then its two parts once."""
    runs, cpu, H = [], [], None
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        H = closed_form_hessian(params, X, cfg, loss=loss, target=y)
        D = H.dense()
        runs.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    t, c = time.perf_counter(), time.process_time()
    O, F = H.outer.dense(), H.functional.dense()
    parts = (time.perf_counter() - t, time.process_time() - c)
    return H, D, O, F, runs, cpu, parts


def _reference(params, X, cfg, loss, y, chunk: int, quiet: bool, desc: str):
    """The float64 reference on the batch, as the size-weighted mean of per-chunk Hessians.

    The batch loss is the mean over sequences, so this is exact; chunks keep the reference's
    dense ``(B·L·d)²`` loss Hessian and ``J^T H_Z J`` small (they grow with the square of B).
    """
    B = X.shape[0]
    acc = None
    t, c = time.perf_counter(), time.process_time()
    for i in progress(range(0, B, chunk), quiet, desc=desc, unit="chunk"):
        j = min(i + chunk, B)
        H = reference.hessian(params, X[i:j], cfg, loss=loss, target=y[i:j])
        w = (j - i) / B
        mats = [H.dense() * w, H.outer.dense() * w, H.functional.dense() * w]
        acc = mats if acc is None else [a + m for a, m in zip(acc, mats)]
    return acc, (time.perf_counter() - t, time.process_time() - c)


def _phase(model, images, labels, dtype, args, quiet, tag) -> dict:
    cfg = model.cfg
    names = vitmod.BLOCK_NAMES
    X = model.embed(images, dtype)
    params = model.block_params(dtype)
    loss_value = float(model.per_sample_losses(images, labels).mean())
    H, D, O, F, runs, cpu, (parts_s, parts_cpu) = _time_closed_form(params, X, cfg, model.head_loss, labels, args.repeats)
    closed = {"full": D.to(torch.float64), "outer": O.to(torch.float64), "functional": F.to(torch.float64)}
    sizes = list(H.sizes)
    off = _offsets(sizes)
    X64, p64 = model.embed(images, torch.float64), model.block_params(torch.float64)
    (R_full, R_outer, R_fun), (ref_s, ref_cpu) = _reference(p64, X64, cfg, model.head_loss, labels, args.ref_chunk, quiet,
                                                  f"{tag}: autograd reference")
    ref = {"full": R_full, "outer": R_outer, "functional": R_fun}

    # validation
    errors = {}
    for part in _PARTS:
        whole = float(torch.linalg.matrix_norm(ref[part])) or 1.0
        per = {}
        for a, b in pairs(names):
            R = _block(ref[part], names, off, a, b)
            # a block that is exactly zero in the reference is measured against the whole matrix's norm
            per[f"{a},{b}"] = rel_error(_block(closed[part], names, off, a, b), R, None if R.any() else whole)
        errors[part] = {"whole": rel_error(closed[part], ref[part], whole), "max_over_blocks": max(per.values()), "blocks": per}
    sym = rel_error(closed["full"], closed["full"].T)
    split = rel_error(closed["outer"] + closed["functional"], closed["full"])

    # norms per block pair
    blocks = {}
    for a, b in progress(pairs(names), quiet, desc=f"{tag}: block norms", unit="pair"):
        entry = {}
        for part in _PARTS:
            M = _block(closed[part], names, off, a, b)
            entry[part] = {"fro": float(torch.linalg.matrix_norm(M)), "spectral": linalg.norm2(M), "max_abs": float(M.abs().max())}
        blocks[f"{a},{b}"] = entry

    # eigenvalues
    eps = torch.finfo(dtype).eps
    lam = {part: linalg.eigvalsh(closed[part]) for part in progress(_PARTS, quiet, desc=f"{tag}: eigenvalues", unit="matrix")}
    eig = {part: _eig_summary(lam[part], eps) for part in _PARTS}
    eig["diagonal_blocks"] = {a: _eig_summary(linalg.eigvalsh(_block(closed["full"], names, off, a, a)), eps) for a in names}
    whole_norms = {part: {"fro": float(torch.linalg.matrix_norm(closed[part])), "spectral": float(lam[part].abs().max())}
                   for part in _PARTS}
    k = runs.index(statistics.median_low(runs))
    cf_s, cf_cpu = runs[k], cpu[k]
    return {
        "loss": loss_value,
        "test_accuracy": model.test_accuracy,
        "param_norms": {n: float(model.params[n].norm()) for n in names},
        "n_params": sum(sizes),
        "sizes": dict(zip(names, sizes)),
        "validation": {"max_rel_error": max(errors[p]["max_over_blocks"] for p in _PARTS), "by_part": errors,
                       "symmetry_rel_error": sym, "outer_plus_functional_rel_error": split},
        "norms": {"whole": whole_norms, "blocks": blocks},
        "eigenvalues": eig,
        "timings": {
            "closed_form_full_s": cf_s,
            "closed_form_full_runs_s": runs,
            "closed_form_parts_s": parts_s,
            "closed_form_total_s": cf_s + parts_s,
            "reference_s": ref_s,
            "reference_chunk": args.ref_chunk,
            "speedup_total": ref_s / (cf_s + parts_s),
            "cpu_s": {"closed_form_full": cf_cpu, "closed_form_parts": parts_cpu, "closed_form_total": cf_cpu + parts_cpu,
                      "reference": ref_cpu, "speedup_total": ref_cpu / max(cf_cpu + parts_cpu, 1e-9)},
            "what": "wall-clock seconds; the closed form's full Hessian is the median (low) of the repeats, its outer and "
                    "functional parts one further pass each; the reference computes full, outer and functional together",
        },
        "_dense": closed["full"],
        "_lam": {p: lam[p].numpy() for p in _PARTS},
        "_sizes": sizes,
    }


# ----------------------------------------------------------------------------- figures and text


def _figures(tmp: Path, phases: dict, names) -> list[str]:
    labels = [_LABELS[n] for n in names]
    top = max(float(ph["_dense"].abs().max()) for ph in phases.values())
    vmax = math.ceil(math.log10(top) * 2) / 2
    vmin = vmax - 10
    files = []
    for tag, ph in phases.items():
        D, sizes = ph["_dense"].numpy(), ph["_sizes"]
        na = sum(sizes[:3])
        title = "initialisation" if tag == "init" else "trained"
        fname = f"hessian_{tag}.png"
        zero = int((D == 0).all(1).sum())  # a ReLU unit off on every token: its W_1 column and W_2 row
        note = (f"{zero} of {D.shape[0]} rows and columns are exactly zero: the weights of hidden units the ReLU "
                "switches off on every token of the batch (a W1 column and a W2 row each)." if zero else "")
        plots.hessian_heatmap(
            tmp / fname,
            [(D, labels, sizes, f"Hessian (block weights, n = {sum(sizes)})"),
             (D[:na, :na], labels[:3], sizes[:3], "Hessian (self-attention)")],
            vmin, vmax,
            f"log10|H| of the digits-ViT block, {title} (test accuracy {100 * ph['test_accuracy']:.1f}%, loss {ph['loss']:.3f})",
            note,
        )
        files.append(fname)
    pair_labels = [f"{_LABELS[a]},{_LABELS[b]}" for a, b in pairs(names)]
    groups = {}
    for tag, ph in phases.items():
        groups["initialisation" if tag == "init" else "trained"] = {
            part: [ph["norms"]["blocks"][f"{a},{b}"][part]["spectral"] for a, b in pairs(names)] for part in ("outer", "functional", "full")
        }
    plots.block_norm_bars(tmp / "block_norms.png", groups, pair_labels, "Spectral norm per Hessian block: outer (Gauss-Newton) vs functional term")
    files.append("block_norms.png")
    plots.eigen_spectrum(
        tmp / "spectrum.png",
        {("initialisation" if t == "init" else "trained"): {
            f"{p} ({ph['eigenvalues'][p]['n_negative']} of {ph['eigenvalues'][p]['n']} < 0)": ph["_lam"][p] for p in _PARTS}
         for t, ph in phases.items()},
        "Eigenvalues of the block Hessian and of its two parts (counts beyond n·eps·max|λ|)",
    )
    files.append("spectrum.png")
    return files


def _threads(n) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def _markdown(rep: dict, phases: dict, names) -> str:
    m = rep["model"]
    tr = rep["training"]
    v = rep["validation"]
    lines = [
        "# blockhess report: exact Hessian of a trained Transformer block",
        "",
        f"Model: one-block post-LN ViT on scikit-learn digits ({m['n_train']} train / {m['n_test']} test images, 8×8), "
        f"{m['patch']}×{m['patch']} patches → L = {m['tokens']} tokens, d_model = {m['d_model']}, d_ff = {m['d_ff']}, "
        f"d_k = {m['d_k']}, one head, ReLU, no biases in the block, LayerNorm without affine, eps = {m['ln_eps']}; "
        f"mean-pool + linear head, cross-entropy. Test accuracy **{100 * rep['test_accuracy']:.2f}%** "
        f"(at initialisation {100 * phases['init']['test_accuracy']:.2f}%).",
        "",
        f"Training: {tr.get('steps')} AdamW steps (lr {tr.get('lr')}, batch {tr.get('batch_size')}, seed {rep['seeds']['model']}), "
        f"{_fmt(tr.get('train_seconds', float('nan')))} s on {_threads(tr.get('threads'))} "
        f"({'trained in this run' if tr.get('trained_in_this_run') else 'loaded from ' + str(rep['checkpoint'])}).",
        "",
        f"Hessian: w.r.t. W_Q, W_K, W_V, W_1, W_2 ({rep['n_params']} weights, a {rep['n_params']}×{rep['n_params']} matrix) "
        f"of the mean cross-entropy over a fixed batch of {rep['batch']} training images (seed {rep['seeds']['batch']}); "
        f"closed form in {rep['dtype']}, torch {rep['environment']['torch']}, {_threads(rep['environment']['threads'])}.",
        "",
        "## Validation against autograd (`bh.reference`, float64, same batch)",
        "",
        f"Largest relative Frobenius error over all block pairs, both weight settings and the full, outer and functional "
        f"parts: **{v['max_rel_error']:.2e}** (tolerance {v['tolerance']:.0e}: {'pass' if v['passed'] else 'FAIL'}).",
        "",
        "| weights | full | outer | functional | whole full matrix | symmetry | outer+functional−full |",
        "|---|---|---|---|---|---|---|",
    ]
    for tag, ph in phases.items():
        e = ph["validation"]
        lines.append(
            f"| {tag} | {e['by_part']['full']['max_over_blocks']:.2e} | {e['by_part']['outer']['max_over_blocks']:.2e} | "
            f"{e['by_part']['functional']['max_over_blocks']:.2e} | {e['by_part']['full']['whole']:.2e} | "
            f"{e['symmetry_rel_error']:.1e} | {e['outer_plus_functional_rel_error']:.1e} |"
        )
    lines += [
        "",
        "## Timings (this run)",
        "",
        "| weights | closed form, full (median of %d) | then outer and functional parts (added time) | autograd reference (full, outer, functional) | speed-up | CPU seconds: closed form / reference |" % rep["repeats"],
        "|---|---|---|---|---|---|",
    ]
    for tag, ph in phases.items():
        t = ph["timings"]
        c = t["cpu_s"]
        lines.append(f"| {tag} | {t['closed_form_full_s']:.3f} s | {t['closed_form_parts_s']:.3f} s | {t['reference_s']:.2f} s | "
                     f"{t['speedup_total']:.0f}× | {c['closed_form_total']:.2f} / {c['reference']:.1f} ({c['speedup_total']:.0f}×) |")
    env = rep["environment"]
    lines += [
        "",
        f"Wall-clock seconds of this process; {_threads(env['threads'])}, {env['logical_cpus']} CPUs, load average "
        f"{_load(env['load_average_at_start'])} at the start and {_load(env['load_average_at_end'])} at the end (1 min): other work on the "
        "machine stretches wall time, less so CPU time.",
        "",
        "The reference is `torch.func.hessian` of the loss through a plain forward, plus `J^T ∇²ℓ J` from `jacrev` for the "
        f"outer part, run on chunks of {rep['reference_chunk']} images (the batch Hessian is the mean of the chunks').",
        "",
        "## Hessian entries",
        "",
        "![init](hessian_init.png)",
        "",
        "![trained](hessian_trained.png)",
        "",
        "## Norms per block pair",
        "",
    ]
    for tag, ph in phases.items():
        lines += [
            f"**{tag}** (loss {ph['loss']:.4f}; ‖H‖₂ = {_fmt(ph['norms']['whole']['full']['spectral'])}, "
            f"‖outer‖₂ = {_fmt(ph['norms']['whole']['outer']['spectral'])}, ‖functional‖₂ = {_fmt(ph['norms']['whole']['functional']['spectral'])})",
            "",
            "| block | ‖H‖_F | ‖H‖₂ | ‖outer‖_F | ‖outer‖₂ | ‖functional‖_F | ‖functional‖₂ | max abs entry |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for a, b in pairs(names):
            n = ph["norms"]["blocks"][f"{a},{b}"]
            lines.append(
                f"| {a},{b} | {_fmt(n['full']['fro'])} | {_fmt(n['full']['spectral'])} | {_fmt(n['outer']['fro'])} | "
                f"{_fmt(n['outer']['spectral'])} | {_fmt(n['functional']['fro'])} | {_fmt(n['functional']['spectral'])} | "
                f"{_fmt(n['full']['max_abs'])} |"
            )
        lines.append("")
    lines += ["![block norms](block_norms.png)", "", "## Eigenvalues", "",
              "Counts use the tolerance n·ε·max|λ| (ε of the closed form's dtype); "
              "the outer part is positive semi-definite, so its negative count should be 0.", "",
              "| weights | matrix | λ_min | λ_max | λ_min/λ_max | # negative | # positive | # ≈ 0 | Σλ<0 / Σλ>0 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for tag, ph in phases.items():
        rows = [(p, ph["eigenvalues"][p]) for p in _PARTS] + [(f"H[{a},{a}]", ph["eigenvalues"]["diagonal_blocks"][a]) for a in names]
        for label, e in rows:
            ratio = e["min"] / e["max"] if e["max"] > 0 else float("nan")
            mass = e["sum_negative"] / e["sum_positive"] if e["sum_positive"] > 0 else float("nan")
            lines.append(f"| {tag} | {label} | {_fmt(e['min'])} | {_fmt(e['max'])} | {_fmt(ratio)} | {e['n_negative']} | "
                         f"{e['n_positive']} | {e['n_near_zero']} | {_fmt(mass)} |")
    lines += ["", "![spectrum](spectrum.png)", "",
              "Source: arXiv 2510.16927 (Petrov, Kiselev, Meshkov, Grabovoy), §5.1–5.4 (MNIST ViT, Figs. 3–5). "
              "All numbers: `report.json`.", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command


def run(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if args.steps is not None and args.steps < 0:
        raise ValueError(f"--steps must be >= 0, got {args.steps}")
    if args.steps is not None and args.checkpoint is not None:
        raise ValueError("--steps has no effect with --checkpoint (the model is read, not trained): give one of them")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.ref_chunk < 1:
        raise ValueError(f"--ref-chunk must be >= 1, got {args.ref_chunk}")
    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    quiet = bool(args.quiet)
    dtype = _DTYPES[args.dtype]
    out = Path(args.out)
    t_start = time.perf_counter()
    with atomic_dir(out) as tmp:  # checks --out first
        env = environment()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        vit = vitmod.load_for_command(args.checkpoint, quiet=quiet, seed=args.seed, steps=args.steps)
        vitmod.check_batch("--batch", args.batch, vit)
        n_train = len(vit.train_labels)
        gen = torch.Generator().manual_seed(args.seed + 3)
        idx = torch.randperm(n_train, generator=gen)[: args.batch].sort().values
        images, labels = vit.train_images[idx], vit.train_labels[idx]
        # warm-up (one-time dispatch and allocation costs stay out of the timings)
        warm = vit.embed(images[:2], torch.float64)
        closed_form_hessian(vit.block_params(torch.float64), warm, vit.cfg, loss=vit.head_loss, target=labels[:2])
        reference.hessian(vit.block_params(torch.float64), warm[:1], vit.cfg, loss=vit.head_loss, target=labels[:1])
        phases = {}
        for tag, model in (("init", vit.at_init()), ("trained", vit)):
            phases[tag] = _phase(model, images, labels, dtype, args, quiet, tag)
        names = vitmod.BLOCK_NAMES
        figures = _figures(tmp, phases, names)
        max_err = max(ph["validation"]["max_rel_error"] for ph in phases.values())
        tol = _TOLERANCE[args.dtype]
        rep = {
            "command": "blockhess report",
            "paper": "arXiv 2510.16927, sections 5.1-5.4",
            "model": {**vit.arch, "tokens": vit.n_tokens, "n_classes": vitmod.N_CLASSES, "n_train": n_train,
                      "n_test": len(vit.test_labels), "block": {k: getattr(vit.cfg, k) for k in vit.cfg.__dataclass_fields__}},
            "checkpoint": vit.checkpoint,
            "training": {k: v for k, v in vit.train_info.items() if k != "loss_history"},
            "test_accuracy": vit.test_accuracy,
            "seeds": {"model": vit.seed, "batch": args.seed, "batch_generator_seed": args.seed + 3},
            "batch": args.batch,
            "batch_indices": idx.tolist(),
            "dtype": args.dtype,
            "reference_dtype": "float64",
            "reference_chunk": args.ref_chunk,
            "repeats": args.repeats,
            "n_params": phases["trained"]["n_params"],
            "sizes": phases["trained"]["sizes"],
            "environment": {**env, "load_average_at_end": load_average()},
            "validation": {
                "max_rel_error": max_err,
                "definition": "max over weights (init, trained), parts (full, outer, functional) and block pairs of "
                              "||closed - reference||_F / ||reference||_F",
                "tolerance": tol,
                "passed": max_err <= tol,
                "init": phases["init"]["validation"],
                "trained": phases["trained"]["validation"],
            },
            "norms": {t: ph["norms"] for t, ph in phases.items()},
            "eigenvalues": {t: ph["eigenvalues"] for t, ph in phases.items()},
            "timings": {t: ph["timings"] for t, ph in phases.items()},
            "phases": {t: {k: ph[k] for k in ("loss", "test_accuracy", "param_norms")} for t, ph in phases.items()},
            "figures": figures,
        }
        rep["timings"]["report_total_s"] = time.perf_counter() - t_start
        write_json(tmp / "report.json", rep)
        (tmp / "report.md").write_text(_markdown(rep, phases, names))
    if not quiet:
        t = rep["timings"]["trained"]
        print(f"blockhess report: wrote {out}/ (test accuracy {100 * vit.test_accuracy:.1f}%, max rel error vs autograd "
              f"{max_err:.1e}, full Hessian and its outer/functional parts by closed form {t['closed_form_total_s']:.2f} s "
              f"vs autograd {t['reference_s']:.1f} s)")
    return 0 if max_err <= tol else 1
