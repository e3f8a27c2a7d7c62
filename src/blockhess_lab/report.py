r"""``blockhess report``: the exact Hessian of the digits ViT, of its block and of the whole model, checked against autograd.

On a fixed batch of training images of the digits ViT (:mod:`~blockhess_lab.vit`),
at initialisation and at the trained weights:

1. the whole model (:mod:`~blockhess_lab.report_model`): the exact Hessian of the mean
   cross-entropy w.r.t. *every* parameter (patch embedding, the block's weights, classifier) by
   :func:`blockhess.hessian` of ``vit.model_cfg``, its outer and functional parts, checked against
   :func:`blockhess.reference.hessian` on the first ``--model-ref-batch`` images; norms per
   parameter group and group pair, eigenvalues, a heat map with the groups labelled (the paper's
   Figs. 3–4); the per-group Hessian spectral norms and parameter norms at the training snapshots
   (the paper's Fig. 5); a two-block ViT of the same recipe, trained in this run, with its
   cross-layer blocks, checked against the reference on ``--two-block-batch`` images;
2. the block: the exact Hessian w.r.t. the block's weights ``W_Q, W_K, W_V, W_1, W_2`` by
   :func:`blockhess.hessian` with the pooling and head as the loss ``ℓ(Z)`` (``vit.head_loss``)
   and the embedded patches as the input ``X``, with its outer and functional parts (paper
   eq. 10), checked against :func:`blockhess.reference.hessian` on the whole batch; per block
   pair Frobenius and spectral norms; eigenvalues of the full Hessian, of its diagonal blocks
   and of the two parts; timings of both methods;
3. figures; ``report.json`` and ``report.md``.

Everything is written into a temporary folder next to ``--out`` and moved into place only
when complete, so a failed run leaves no partial report (and an older report intact).
Exit status: 0; 1 when the report is written but a check fails (float64: a relative Frobenius
error above 1e-10; a float32 closed form: an error above 3 times float32 autograd's own on the
same inputs, :func:`~blockhess_lab.hessian_stats.float32_verdict`); 2 with one line on stderr for
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
from . import report_model
from . import vit as vitmod
from .hessian_stats import FLOAT32_FACTOR, block, compare, eig_summary, float32_verdict
from .outputs import atomic_dir, out_help, write_json
from .runtime import add_quiet_argument, add_threads_argument, environment, load_average, progress, torch_threads

HELP = "exact Hessian of the digits ViT (whole model, training dynamics, two blocks, the block): closed form vs autograd, norms, spectra, figures"

_DTYPES = {"float64": torch.float64, "float32": torch.float32}
_PARTS = ("full", "outer", "functional")
#: figure labels of the weights: the one table's names, the FFN's with their W (W1, not 1)
_LABELS = {n: f"W{s}" if s.isdigit() else s for n, s in SHORT_NAMES.items()}
TOLERANCE = 1e-10  # float64; float32 is judged by float32 autograd's own error (hessian_stats.float32_verdict)


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
                   help="timed runs of the block's closed form; the median is reported (default: 3)")
    p.add_argument("--model-ref-batch", type=int, default=16, metavar="N",
                   help="images of the batch (its first N) on which the whole model's closed form is checked against "
                        "autograd, whose cost grows with the parameters times the images (default: 16)")
    p.add_argument("--two-block-batch", type=int, default=8, metavar="N",
                   help="images of the batch (its first N) for the two-block ViT's Hessian and its check (default: 8)")
    add_threads_argument(p)
    add_quiet_argument(p)
    p.add_argument("--ref-chunk", type=int, default=4, help=argparse.SUPPRESS)


# ----------------------------------------------------------------------------- numbers


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
    """The reference on the batch (in the dtype of ``params``), as the size-weighted mean of per-chunk Hessians.

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
    return dict(zip(_PARTS, acc)), (time.perf_counter() - t, time.process_time() - c)


def _phase(model, images, labels, dtype, args, quiet, tag) -> dict:
    cfg = model.cfg
    names = vitmod.BLOCK_NAMES
    X = model.embed(images, dtype)
    params = model.block_params(dtype)
    loss_value = float(model.per_sample_losses(images, labels).mean())
    H, D, O, F, runs, cpu, (parts_s, parts_cpu) = _time_closed_form(params, X, cfg, model.head_loss, labels, args.repeats)
    own = {"full": D, "outer": O, "functional": F}
    closed = {p: m.to(torch.float64) for p, m in own.items()}
    sizes = list(H.sizes)
    X64, p64 = model.embed(images, torch.float64), model.block_params(torch.float64)
    ref, (ref_s, ref_cpu) = _reference(p64, X64, cfg, model.head_loss, labels, args.ref_chunk, quiet, f"{tag}: autograd reference")

    # validation
    validation = compare(closed, ref, names, sizes)
    if dtype == torch.float32:  # judged by float32 autograd's own error on the same inputs
        a32, _ = _reference(params, X, cfg, model.head_loss, labels, args.ref_chunk, quiet, f"{tag}: float32 autograd")
        validation["float32"] = float32_verdict(own, a32, ref)
        validation["passed"] = all(v["passed"] for v in validation["float32"].values())
    else:
        validation["passed"] = validation["max_rel_error"] <= TOLERANCE
    validation["symmetry_rel_error"] = rel_error(closed["full"], closed["full"].T)
    validation["outer_plus_functional_rel_error"] = rel_error(closed["outer"] + closed["functional"], closed["full"])

    # norms per block pair
    blocks = {}
    for a, b in progress(pairs(names), quiet, desc=f"{tag}: block norms", unit="pair"):
        entry = {}
        for part in _PARTS:
            M = block(closed[part], names, sizes, a, b)
            entry[part] = {"fro": float(torch.linalg.matrix_norm(M)), "spectral": linalg.norm2(M), "max_abs": float(M.abs().max())}
        blocks[f"{a},{b}"] = entry

    # eigenvalues
    eps = torch.finfo(dtype).eps
    lam = {part: linalg.eigvalsh(closed[part]) for part in progress(_PARTS, quiet, desc=f"{tag}: eigenvalues", unit="matrix")}
    eig = {part: eig_summary(lam[part], eps) for part in _PARTS}
    eig["diagonal_blocks"] = {a: eig_summary(linalg.eigvalsh(block(closed["full"], names, sizes, a, a)), eps) for a in names}
    whole_norms = {part: {"fro": float(torch.linalg.matrix_norm(closed[part])), "spectral": float(lam[part].abs().max())}
                   for part in _PARTS}
    k = runs.index(statistics.median_low(runs))
    cf_s, cf_cpu = runs[k], cpu[k]
    return {
        "loss": loss_value,
        "test_accuracy": model.test_accuracy,
        "param_norms": {n: float(v.norm()) for n, v in model.block_params().items()},
        "n_params": sum(sizes),
        "sizes": dict(zip(names, sizes)),
        "validation": validation,
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
        "_own": D,
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


def _markdown(rep: dict, phases: dict, names, models: dict, dyn: dict, two: dict) -> str:
    m = rep["model"]
    tr = rep["training"]
    v = rep["validation"]
    if rep["dtype"] == "float64":
        verdict = f"tolerance {v['tolerance']:.0e}"
    else:
        verdict = f"float32: each part within {FLOAT32_FACTOR:g}× float32 autograd's own error on the same inputs"
    lines = [
        "# blockhess report: exact Hessians of the digits ViT, the whole model and its block",
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
        f"Every Hessian is of the mean cross-entropy over a fixed batch of {rep['batch']} training images (seed "
        f"{rep['seeds']['batch']}) or its first images where said; closed form in {rep['dtype']}, torch "
        f"{rep['environment']['torch']}, {_threads(rep['environment']['threads'])}. All checks against autograd "
        f"(`bh.reference`, `torch.func`, float64): largest relative Frobenius error **{v['max_rel_error']:.2e}** "
        f"({verdict}: {'pass' if v['passed'] else 'FAIL'}).",
        "",
    ]
    lines += report_model.markdown(rep, models, dyn, two)
    lines += [
        "## The block: W_Q, W_K, W_V, W_1, W_2",
        "",
        f"The Hessian w.r.t. the block's weights ({rep['n_params']} weights, a {rep['n_params']}×{rep['n_params']} matrix) "
        "by `bh.hessian` of the block with the pooling and head as a callable loss of its output and the embedded "
        "patches as its input: the blocks.0 part of the whole model's Hessian above, computed on its own.",
        "",
        "### Validation against autograd (`bh.reference`, float64, same batch)",
        "",
        f"Largest relative Frobenius error over all block pairs, both weight settings and the full, outer and functional "
        f"parts: **{max(ph['validation']['max_rel_error'] for ph in phases.values()):.2e}** "
        f"({'pass' if all(ph['validation']['passed'] for ph in phases.values()) else 'FAIL'}).",
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
        "### Timings (this run)",
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
        "### Hessian entries",
        "",
        "![init](hessian_init.png)",
        "",
        "![trained](hessian_trained.png)",
        "",
        "### Norms per block pair",
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
    lines += ["![block norms](block_norms.png)", "", "### Eigenvalues", "",
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
    for option, value in (("--model-ref-batch", args.model_ref_batch), ("--two-block-batch", args.two_block_batch)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
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
        plan = vitmod.would_train(args.checkpoint, seed=args.seed, steps=args.steps)
        if plan:  # checked before a model is trained, too
            vitmod.check_batch("--batch", args.batch, plan["n_train"])
        vit = vitmod.load_for_command(args.checkpoint, quiet=quiet, seed=args.seed, steps=args.steps)
        vitmod.check_batch("--batch", args.batch, len(vit.train_labels))
        n_train = len(vit.train_labels)
        gen = torch.Generator().manual_seed(args.seed + 3)
        idx = torch.randperm(n_train, generator=gen)[: args.batch].sort().values
        images, labels = vit.train_images[idx], vit.train_labels[idx]
        # warm-up (one-time dispatch and allocation costs stay out of the timings)
        warm = vit.embed(images[:2], torch.float64)
        closed_form_hessian(vit.block_params(torch.float64), warm, vit.cfg, loss=vit.head_loss, target=labels[:2])
        reference.hessian(vit.block_params(torch.float64), warm[:1], vit.cfg, loss=vit.head_loss, target=labels[:1])
        closed_form_hessian(vit.params, vit.model_inputs(images[:2]), vit.model_cfg, loss="ce", target=labels[:2])
        tol = TOLERANCE if dtype == torch.float64 else None
        initial = vit.at_init()
        phases, models = {}, {}
        for tag, model in (("init", initial), ("trained", vit)):
            phases[tag] = _phase(model, images, labels, dtype, args, quiet, tag)
        n_ref = min(args.model_ref_batch, args.batch)
        for tag, model in (("init", initial), ("trained", vit)):
            models[tag] = report_model.model_phase(model, images, labels, dtype, n_ref, tol, quiet, tag,
                                                   block_dense=phases[tag]["_own"])
            if tol is not None:  # two closed forms of the same numbers (float32: each its own rounding, not judged)
                v = models[tag]["validation"]
                v["passed"] = v["passed"] and v["block_agreement_rel_error"] <= tol
        dyn = report_model.dynamics(vit, images, labels, dtype, quiet, init_dense=models["init"]["_dense"])
        n_two = min(args.two_block_batch, args.batch)
        two = report_model.two_blocks(vit, images[:n_two], labels[:n_two], dtype, tol, quiet)
        names = vitmod.BLOCK_NAMES
        figures = report_model.figures(tmp, models, dyn, two) + _figures(tmp, phases, names)
        checks = {"block": {t: ph["validation"] for t, ph in phases.items()},
                  "model": {t: ph["validation"] for t, ph in models.items()}, "two_blocks": {"trained": two["validation"]}}
        max_err = max(v["max_rel_error"] for c in checks.values() for v in c.values())
        passed = all(v["passed"] for c in checks.values() for v in c.values())
        public = lambda ph: {k: v for k, v in ph.items() if not k.startswith("_")}  # noqa: E731
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
                "definition": "max of ||closed - reference||_F / ||reference||_F over parts (full, outer, functional) and "
                              "block pairs, of the block's Hessian (whole batch; init, trained), the whole model's (its "
                              "validation images; init, trained) and the two-block model's (trained)",
                "tolerance": tol,
                "rule": "float64: every error <= 1e-10, and the whole model's blocks.0 part within 1e-10 of the block's "
                        f"Hessian; float32: each part's error within {FLOAT32_FACTOR:g}x float32 autograd's own on the "
                        "same inputs, or the rounding of the answer (the .float32 entries)",
                "passed": passed,
                "init": phases["init"]["validation"],
                "trained": phases["trained"]["validation"],
                "model": {t: {"max_rel_error": v["max_rel_error"], "passed": v["passed"]} for t, v in checks["model"].items()},
                "two_blocks": {"max_rel_error": two["validation"]["max_rel_error"], "passed": two["validation"]["passed"]},
            },
            "norms": {t: ph["norms"] for t, ph in phases.items()},
            "eigenvalues": {t: ph["eigenvalues"] for t, ph in phases.items()},
            "timings": {t: ph["timings"] for t, ph in phases.items()},
            "phases": {t: {k: ph[k] for k in ("loss", "test_accuracy", "param_norms")} for t, ph in phases.items()},
            "model_hessian": {"validation_images": n_ref, **{t: public(ph) for t, ph in models.items()}},
            "training_dynamics": dyn,
            "two_blocks": public(two),
            "figures": figures,
        }
        rep["timings"]["report_total_s"] = time.perf_counter() - t_start
        write_json(tmp / "report.json", rep)
        (tmp / "report.md").write_text(_markdown(rep, phases, names, models, dyn, two))
    if not quiet:
        t = rep["model_hessian"]["trained"]["timings"]
        print(f"blockhess report: wrote {out}/ (test accuracy {100 * vit.test_accuracy:.1f}%, checks "
              f"{'passed' if passed else 'FAILED'}, max rel error vs autograd {max_err:.1e}; the whole model's Hessian "
              f"(n = {rep['model_hessian']['trained']['n_params']}) and its parts by closed form {t['closed_form_total_s']:.1f} s)")
    return 0 if passed else 1
