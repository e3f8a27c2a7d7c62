r"""The whole-model sections of ``blockhess report``: the exact Hessian of the digits ViT's loss w.r.t.
*every* parameter (patch embedding, the block's weights, classifier), its training dynamics over
the first steps, and a two-block ViT's cross-layer blocks (the paper's Figs. 3–5, §5.1–5.4).

Every Hessian here is :func:`blockhess.hessian` of the model (``vit.model_cfg``, a
:class:`~blockhess.config.ModelConfig`) with ``loss="ce"``; the ground truth is
:func:`blockhess.reference.hessian` of the same config (``torch.func`` on a plain forward, the
whole sub-batch at once), on the first ``--model-ref-batch`` images of the report's batch (its
cost grows with the number of parameters times the images: docs/results.md, "The report").

* :func:`model_phase`: one weight setting (init or trained) of the one-block model;
* :func:`dynamics`: per-group Hessian spectral norms and parameter norms at the training snapshots
  (``vit.snapshots``; the paper's Fig. 5);
* :func:`two_blocks`: the two-block ViT of the same recipe, trained in this run;
* :func:`figures` and :func:`markdown`: their figures and the report's text for them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

import blockhess as bh
from blockhess import linalg, reference
from blockhess.config import SHORT_NAMES, block_prefix
from blockhess.linalg import rel_error
from blockhess.result import pairs
from . import plots
from . import vit as vitmod
from .hessian_stats import BLOCK_FLOOR, PARTS, compare, eig_summary, float32_verdict, group_block, pair_norms
from .runtime import progress

__all__ = ["label", "groups", "model_phase", "dynamics", "two_blocks", "figures", "markdown"]

_OUTSIDE = {"W_E": "E", "b_E": "bE", "W_H": "H", "b_H": "bH"}


def label(name: str, n_blocks: int = 1) -> str:
    """A figure label for a model parameter: ``E``, ``bE``, ``Q``, ``K``, ``V``, ``W1``, ``W2``,
    ``H``, ``bH``; with several blocks ``0:Q`` for block 0's ``W_Q``."""
    if name in _OUTSIDE:
        return _OUTSIDE[name]
    i, _, own = name.removeprefix("blocks.").partition(".")
    short = SHORT_NAMES.get(own, own)
    short = f"W{short}" if short.isdigit() else short
    return f"{i}:{short}" if n_blocks > 1 else short


def groups(names) -> dict[str, tuple[str, ...]]:
    """The paper's Fig. 5 groups of a one-block model, each the names it has of: embedding
    ``(W_E, b_E)``, ``W_Q``, ``W_K``, ``W_V``, FeedForward ``(W_1, W_2)``, head ``(W_H, b_H)``."""
    pre = block_prefix(0)
    spec = {"embedding": ("W_E", "b_E"), "W_Q": (pre + "W_Q",), "W_K": (pre + "W_K",), "W_V": (pre + "W_V",),
            "FeedForward": (pre + "W_1", pre + "W_2"), "head": ("W_H", "b_H")}
    return {g: tuple(n for n in ns if n in names) for g, ns in spec.items() if any(n in names for n in ns)}


def _clock():
    return time.perf_counter(), time.process_time()


def _since(t) -> tuple[float, float]:
    return time.perf_counter() - t[0], time.process_time() - t[1]


def _closed(model, images, labels, dtype, parts: bool = True):
    """The closed form on ``images``: ``(H, {part: dense}, seconds)``."""
    x = model.model_inputs(images, dtype)
    t = _clock()
    H = bh.hessian(model.model_params(dtype), x, model.model_cfg, loss="ce", target=labels)
    mats = {"full": H.dense()}
    full = _since(t)
    t = _clock()
    if parts:
        mats["outer"], mats["functional"] = H.outer.dense(), H.functional.dense()
    return H, mats, {"full": full, "parts": _since(t)}


def _reference(model, images, labels, dtype):
    """:func:`blockhess.reference.hessian` of the model on ``images`` in ``dtype``: ``({part: dense}, seconds)``."""
    t = _clock()
    R = reference.hessian(model.model_params(dtype), model.model_inputs(images, dtype), model.model_cfg, loss="ce",
                          target=labels)
    mats = {"full": R.dense(), "outer": R.outer.dense(), "functional": R.functional.dense()}
    return mats, _since(t)


def _validation(model, images, labels, dtype, n_ref: int, tol: float | None) -> dict:
    """The closed form against the reference on the first ``n_ref`` images: float64 errors; for a
    float32 closed form also float32 autograd's on the same inputs and the verdict."""
    sub, ysub = images[:n_ref], labels[:n_ref]
    H, closed, t_closed = _closed(model, sub, ysub, dtype)
    ref, t_ref = _reference(model, sub, ysub, torch.float64)
    out = {"images": n_ref, **compare({p: m.to(torch.float64) for p, m in closed.items()}, ref, H.names, H.sizes),
           "timings": {"closed_form_s": t_closed["full"][0] + t_closed["parts"][0], "reference_s": t_ref[0],
                       "cpu_s": {"closed_form": t_closed["full"][1] + t_closed["parts"][1], "reference": t_ref[1]}}}
    if dtype == torch.float32:
        a32, t32 = _reference(model, sub, ysub, torch.float32)
        out["float32"] = float32_verdict(closed, a32, ref)
        out["passed"] = all(v["passed"] for v in out["float32"].values())
        out["timings"]["reference_float32_s"] = t32[0]
    else:
        out["passed"] = out["max_rel_error"] <= tol
    return out


def _identities(mats: dict, eps: float) -> dict:
    lam = {p: linalg.eigvalsh(m) for p, m in mats.items()}
    return lam, {
        "symmetry_rel_error": rel_error(mats["full"], mats["full"].T),
        "outer_plus_functional_rel_error": rel_error(mats["outer"] + mats["functional"], mats["full"]),
    }


def model_phase(model, images, labels, dtype, n_ref: int, tol: float | None, quiet: bool, tag: str,
                block_dense: torch.Tensor | None = None) -> dict:
    """The one-block model at one weight setting: the closed form (full, outer, functional) on the
    whole batch, validated on its first ``n_ref`` images; per group and group pair norms;
    eigenvalues; with ``block_dense`` (the block section's closed form on the same batch, in
    ``dtype``) the agreement of the model's ``blocks.0`` part with it."""
    with progress(None, quiet, total=4, desc=f"model {tag}", unit="step") as bar:
        H, mats, t = _closed(model, images, labels, dtype)
        bar.update()
        val = _validation(model, images, labels, dtype, n_ref, tol)
        bar.update()
        names, sizes = H.names, H.sizes
        eps = torch.finfo(dtype).eps
        lam, ident = _identities(mats, eps)
        val.update(ident)
        if block_dense is not None:
            bnames = [block_prefix(0) + n for n in vitmod.BLOCK_NAMES]
            D = group_block(mats["full"], names, sizes, bnames)
            val["block_agreement_rel_error"] = rel_error(D, block_dense)
        bar.update()
        norms = pair_norms(mats, names, sizes)
        bar.update()
    x = model.model_inputs(images)
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(bh.forward(model.params, x, model.model_cfg), labels))
    return {
        "loss": loss,
        "test_accuracy": model.test_accuracy,
        "names": list(names),
        "sizes": dict(zip(names, sizes)),
        "n_params": sum(sizes),
        "param_norms": {n: float(model.params[n].norm()) for n in names},
        "validation": val,
        "norms": {"whole": {p: {"fro": float(torch.linalg.matrix_norm(m.double())), "spectral": float(lam[p].abs().max())}
                            for p, m in mats.items()},
                  "blocks": norms},
        "eigenvalues": {p: eig_summary(lam[p], eps) for p in PARTS},
        "timings": {"closed_form_full_s": t["full"][0], "closed_form_parts_s": t["parts"][0],
                    "closed_form_total_s": t["full"][0] + t["parts"][0],
                    "cpu_s": {"closed_form_full": t["full"][1], "closed_form_parts": t["parts"][1]},
                    "what": "wall-clock seconds of one closed-form pass on the whole batch (the full Hessian, then its "
                            "outer and functional parts, a pass each); validation.timings: the closed form and the "
                            "reference on the validation images"},
        "_dense": mats["full"].to(torch.float64),
        "_sizes": list(sizes),
    }


def dynamics(vit, images, labels, dtype, quiet: bool, init_dense: torch.Tensor | None = None) -> dict:
    """The paper's Fig. 5: at each training snapshot, the spectral norm of each group's diagonal
    Hessian block (:func:`groups`; ``max |λ|`` of its eigenvalues) and the group's parameter norm
    (Frobenius, all its tensors together), with the batch loss and the test accuracy. The closed
    form's full Hessian on the report's batch; ``init_dense`` (the whole batch's, at the
    initialisation) is used for step 0 when that snapshot is the initialisation."""
    if not vit.snapshots:
        return {"skipped": f"the checkpoint {vit.checkpoint} has no training snapshots (format "
                           f"{vit.train_info.get('format_version')}, written before they were kept); run without "
                           "--checkpoint, or delete it, to train again with them"}
    steps = sorted(vit.snapshots)
    names = tuple(vit.params)
    grp = groups(names)
    rows = []
    t = _clock()
    for step in progress(steps, quiet, desc="training dynamics", unit="snapshot"):
        model = vit.at_step(step)
        same_as_init = all(torch.equal(model.params[n], vit.init_params_[n]) for n in names)
        if step == 0 and same_as_init and init_dense is not None:
            D = init_dense
        else:
            D = _closed(model, images, labels, dtype, parts=False)[1]["full"].to(torch.float64)
        sizes = [vit.params[n].numel() for n in names]
        with torch.no_grad():
            loss = float(torch.nn.functional.cross_entropy(bh.forward(model.params, model.model_inputs(images),
                                                                       model.model_cfg), labels))
        rows.append({
            "step": step,
            "loss": loss,
            "test_accuracy": model.test_accuracy,
            "hessian_spectral_norm": {g: float(linalg.eigvalsh(group_block(D, names, sizes, ns)).abs().max())
                                      for g, ns in grp.items()},
            "param_norm": {g: float(torch.cat([model.params[n].reshape(-1) for n in ns]).norm()) for g, ns in grp.items()},
        })
    wall, cpu = _since(t)
    return {"steps": steps, "groups": {g: list(ns) for g, ns in grp.items()}, "snapshots": rows,
            "batch": len(labels), "dtype": str(dtype).removeprefix("torch."), "seconds": wall, "cpu_s": cpu,
            "what": "per group: the spectral norm of its diagonal block of the full Hessian of the batch loss "
                    "(max |eigenvalue|) and the Frobenius norm of its parameters, after that many training steps"}


def two_blocks(vit, images, labels, dtype, tol: float | None, quiet: bool) -> dict:
    """The two-block ViT of ``vit``'s recipe (seed, architecture, optimiser, steps), trained in
    this run, at its trained weights on ``images``: the closed form (full, outer, functional)
    against the reference on the same images, the norms of every block pair (Frobenius) and the
    cross-layer ones (``blocks.0.* × blocks.1.*``)."""
    t = _clock()
    two = vitmod.train_like(vit, n_blocks=2, quiet=quiet)
    train_s = _since(t)[0]
    with progress(None, quiet, total=2, desc="two blocks", unit="step") as bar:
        H, mats, tc = _closed(two, images, labels, dtype)
        bar.update()
        ref, tr = _reference(two, images, labels, torch.float64)
        names, sizes = H.names, H.sizes
        val = compare({p: m.to(torch.float64) for p, m in mats.items()}, ref, names, sizes)
        if dtype == torch.float32:
            a32, _ = _reference(two, images, labels, torch.float32)
            val["float32"] = float32_verdict(mats, a32, ref)
            val["passed"] = all(v["passed"] for v in val["float32"].values())
        else:
            val["passed"] = val["max_rel_error"] <= tol
        bar.update()
    val["symmetry_rel_error"] = rel_error(mats["full"], mats["full"].T)
    val["outer_plus_functional_rel_error"] = rel_error(mats["outer"] + mats["functional"], mats["full"])
    norms = pair_norms(mats, names, sizes, spectral=False)
    b0 = [n for n in names if n.startswith(block_prefix(0))]
    b1 = [n for n in names if n.startswith(block_prefix(1))]
    cross = {f"{a},{b}": norms[f"{a},{b}"] for a in b0 for b in b1}
    return {
        "trained_in_this_run": True,
        "train_seconds": train_s,
        "steps": two.train_info["steps"],
        "test_accuracy": two.test_accuracy,
        "images": len(labels),
        "names": list(names),
        "sizes": dict(zip(names, sizes)),
        "n_params": sum(sizes),
        "validation": val,
        "norms": {"blocks": norms, "cross_layer": cross},
        "timings": {"closed_form_total_s": tc["full"][0] + tc["parts"][0], "reference_s": tr[0],
                    "cpu_s": {"closed_form_total": tc["full"][1] + tc["parts"][1], "reference": tr[1]}},
        "_dense": mats["full"].to(torch.float64),
        "_sizes": list(sizes),
    }


# ----------------------------------------------------------------------------- figures


def _range(mats) -> tuple[float, float]:
    top = max(float(m.abs().max()) for m in mats)
    vmax = math.ceil(math.log10(top) * 2) / 2
    return vmax - 10, vmax


def _zero_note(tag: str, D: torch.Tensor) -> str:
    zero = int((D == 0).all(1).sum())
    return (f"{'Initialisation' if tag == 'init' else 'Trained'}: {zero} of {D.shape[0]} rows and columns are exactly "
            "zero (hidden units the ReLU switches off on every token of the batch: a W1 column and a W2 row each)."
            if zero else "")


def figures(tmp: Path, phases: dict, dyn: dict, two: dict) -> list[str]:
    """The whole model's heat maps (init and trained, one colour scale), its group-pair norms, the
    training dynamics (unless skipped) and the two-block heat map; returns the file names."""
    files = []
    first = next(iter(phases.values()))
    names = first["names"]
    labels = [label(n) for n in names]
    vmin, vmax = _range([ph["_dense"] for ph in phases.values()])
    plots.hessian_heatmap(
        tmp / "model_hessian.png",
        [(ph["_dense"], labels, ph["_sizes"],
          f"{'initialisation' if tag == 'init' else 'trained'} (accuracy {100 * ph['test_accuracy']:.1f}%, loss {ph['loss']:.3f})")
         for tag, ph in phases.items()],
        vmin, vmax, f"log10|H| of the whole digits ViT (every parameter, n = {first['n_params']})",
        " ".join(_zero_note(tag, ph["_dense"]) for tag, ph in phases.items()).strip(),
    )
    files.append("model_hessian.png")
    grids = {}
    for tag, ph in phases.items():
        for part in PARTS:
            M = torch.zeros(len(names), len(names), dtype=torch.float64)
            for a, b in pairs(names):
                i, j = names.index(a), names.index(b)
                M[i, j] = M[j, i] = ph["norms"]["blocks"][f"{a},{b}"][part]["fro"]
            grids[f"{'init' if tag == 'init' else 'trained'}: {part}"] = M.numpy()
    plots.norm_grid(tmp / "model_group_norms.png", grids, labels, 3,
                    "log10 of the Frobenius norm of each parameter-group block of the whole-model Hessian (blank: exactly zero)")
    files.append("model_group_norms.png")
    if "skipped" not in dyn:
        rows = dyn["snapshots"]
        hess = "Hessian spectral norm of the group's diagonal block (log scale)"
        plots.training_curves(
            tmp / "training_dynamics.png", dyn["steps"],
            {hess: {g: [r["hessian_spectral_norm"][g] for r in rows] for g in dyn["groups"]},
             "parameter norm of the group": {g: [r["param_norm"][g] for r in rows] for g in dyn["groups"]}},
            f"The digits ViT over its first {dyn['steps'][-1]} training steps (batch of {dyn['batch']} images)", log=(hess,),
        )
        files.append("training_dynamics.png")
    tn = two["names"]
    tl = [label(n, 2) for n in tn]
    b0 = [i for i, n in enumerate(tn) if n.startswith(block_prefix(0))]
    b1 = [i for i, n in enumerate(tn) if n.startswith(block_prefix(1))]
    sz = two["_sizes"]
    off = [sum(sz[:i]) for i in range(len(sz) + 1)]
    D = two["_dense"]
    cross = D[off[b0[0]]:off[b0[-1] + 1], off[b1[0]]:off[b1[-1] + 1]]
    vmin, vmax = _range([D])
    plots.hessian_heatmap(
        tmp / "two_block_hessian.png",
        [(D, tl, sz, f"every parameter (n = {two['n_params']})"),
         (cross, [tl[i] for i in b0], [sz[i] for i in b0], "cross-layer blocks: block 0 (rows) × block 1 (columns)",
          [tl[i] for i in b1], [sz[i] for i in b1])],
        vmin, vmax,
        f"log10|H| of a two-block digits ViT, trained (accuracy {100 * two['test_accuracy']:.1f}%), {two['images']} images",
        "i:X is block i's weight X.",
    )
    files.append("two_block_hessian.png")
    return files


# ----------------------------------------------------------------------------- text


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def _verdict_line(val: dict) -> str:
    if "float32" in val:
        f = val["float32"]
        return ("float32 closed form against float64 autograd: " + ", ".join(
            f"{p} {f[p]['error']:.2e} (float32 autograd {f[p]['autograd_error']:.2e}, allowed {f[p]['allowed']:.2e})" for p in f)
            + f": {'pass' if val['passed'] else 'FAIL'}")
    return f"largest relative Frobenius error **{val['max_rel_error']:.2e}** ({'pass' if val['passed'] else 'FAIL'})"


def markdown(rep: dict, phases: dict, dyn: dict, two: dict) -> list[str]:
    """The report's lines for the whole model, its training dynamics and the two-block model."""
    m = rep["model_hessian"]
    first = next(iter(phases.values()))
    names = first["names"]
    sizes = first["sizes"]
    grp = ", ".join(f"{n} ({sizes[n]})" for n in names)
    lines = [
        "## The whole model: every parameter",
        "",
        f"The exact Hessian of the mean cross-entropy over the batch of {rep['batch']} images w.r.t. every parameter of the "
        f"digits ViT, n = {first['n_params']}: {grp}. The block has no W_O and no LayerNorm parameters (the paper's "
        "setting: one head, LayerNorm without affine), and the model has no final LayerNorm. Closed form: "
        "`bh.hessian(vit.params, vit.model_inputs(images), vit.model_cfg, loss=\"ce\", target=labels)` "
        f"in {rep['dtype']}; reference: `bh.reference.hessian` of the same config (float64, `torch.func`, the whole "
        f"validation batch at once) on the first {m['validation_images']} images of the batch. Each block pair is "
        f"measured against its own norm, or against {BLOCK_FLOOR:.1e} of its part's norm where that is larger (for "
        "the functional part, of ‖full‖ + ‖outer‖: the reference forms it as full − outer): the functional part's "
        "(W_H, W_H) block and its blocks with b_H are exactly zero (the logits h W_H + b_H have no second derivative "
        "there), and the reference holds only rounding there.",
        "",
        "| weights | validation against autograd | whole full matrix | symmetry | outer+functional−full | blocks.0 part vs the block's Hessian (callable head loss, whole batch) |",
        "|---|---|---|---|---|---|",
    ]
    for tag, ph in phases.items():
        v = ph["validation"]
        agree = v.get("block_agreement_rel_error")
        lines.append(f"| {tag} | {_verdict_line(v)} | {v['by_part']['full']['whole']:.2e} | {v['symmetry_rel_error']:.1e} | "
                     f"{v['outer_plus_functional_rel_error']:.1e} | {'—' if agree is None else f'{agree:.1e}'} |")
    lines += [
        "",
        "| weights | closed form, full (whole batch) | then outer and functional parts | closed form / autograd on the validation images (CPU s) |",
        "|---|---|---|---|",
    ]
    for tag, ph in phases.items():
        t, vt = ph["timings"], ph["validation"]["timings"]
        lines.append(f"| {tag} | {t['closed_form_full_s']:.2f} s | {t['closed_form_parts_s']:.2f} s | "
                     f"{vt['cpu_s']['closed_form']:.2f} / {vt['cpu_s']['reference']:.1f} |")
    lines += ["", "![whole-model Hessian](model_hessian.png)", "",
              "Norms of each parameter's diagonal block (all pairs, and spectral norms of the off-diagonal ones, in "
              "`report.json`, `model_hessian.<phase>.norms.blocks`):", ""]
    for tag, ph in phases.items():
        w = ph["norms"]["whole"]
        e = ph["eigenvalues"]
        lines += [
            f"**{tag}** (loss {ph['loss']:.4f}; ‖H‖₂ = {_fmt(w['full']['spectral'])}, ‖outer‖₂ = {_fmt(w['outer']['spectral'])}, "
            f"‖functional‖₂ = {_fmt(w['functional']['spectral'])}; eigenvalues of H in [{_fmt(e['full']['min'])}, "
            f"{_fmt(e['full']['max'])}], {e['full']['n_negative']} of {e['full']['n']} negative; of the outer part "
            f"{e['outer']['n_negative']} negative)",
            "",
            "| parameter | ‖H‖_F | ‖H‖₂ | ‖outer‖_F | ‖outer‖₂ | ‖functional‖_F | ‖functional‖₂ |",
            "|---|---|---|---|---|---|---|",
        ]
        for n in names:
            b = ph["norms"]["blocks"][f"{n},{n}"]
            lines.append(f"| {n} | {_fmt(b['full']['fro'])} | {_fmt(b['full']['spectral'])} | {_fmt(b['outer']['fro'])} | "
                         f"{_fmt(b['outer']['spectral'])} | {_fmt(b['functional']['fro'])} | {_fmt(b['functional']['spectral'])} |")
        lines.append("")
    lines += ["![group-pair norms](model_group_norms.png)", "", "## Training dynamics (the paper's Fig. 5)", ""]
    if "skipped" in dyn:
        lines += [f"Not shown: {dyn['skipped']}.", ""]
    else:
        gnames = list(dyn["groups"])
        lines += [
            f"At {len(dyn['steps'])} snapshots over the first {dyn['steps'][-1]} training steps: the spectral norm of each "
            "group's diagonal block of the exact Hessian (full, on the report's batch, "
            + ", ".join(f"{g} = {' and '.join(ns)}" for g, ns in dyn["groups"].items() if len(ns) > 1)
            + ") and the group's parameter norm. "
            f"{dyn['seconds']:.1f} s for the snapshots' Hessians.",
            "",
            "| step | loss | test accuracy | " + " | ".join(f"‖H[{g}]‖₂" for g in gnames) + " | "
            + " | ".join(f"‖{g}‖" for g in gnames) + " |",
            "|" + "---|" * (3 + 2 * len(gnames)),
        ]
        for r in dyn["snapshots"]:
            lines.append(f"| {r['step']} | {r['loss']:.4f} | {100 * r['test_accuracy']:.1f}% | "
                         + " | ".join(_fmt(r["hessian_spectral_norm"][g]) for g in gnames) + " | "
                         + " | ".join(_fmt(r["param_norm"][g]) for g in gnames) + " |")
        lines += ["", "![training dynamics](training_dynamics.png)", ""]
    v = two["validation"]
    tn = two["names"]
    b0 = [n for n in tn if n.startswith(block_prefix(0))]
    b1 = [n for n in tn if n.startswith(block_prefix(1))]
    lines += [
        "## Two blocks: cross-layer Hessian blocks",
        "",
        f"A two-block ViT of the same recipe (seed, sizes, optimiser, {two['steps']} steps), trained in this run "
        f"({two['train_seconds']:.1f} s; test accuracy {100 * two['test_accuracy']:.2f}%), at its trained weights; the Hessian "
        f"w.r.t. all its n = {two['n_params']} parameters on the first {two['images']} images of the batch, closed form "
        f"against the reference on those images: {_verdict_line(v)}; symmetry {v['symmetry_rel_error']:.1e}, "
        f"outer+functional−full {v['outer_plus_functional_rel_error']:.1e}. Closed form {two['timings']['cpu_s']['closed_form_total']:.2f} s "
        f"of CPU (full and both parts), autograd {two['timings']['cpu_s']['reference']:.1f} s.",
        "",
        "![two-block Hessian](two_block_hessian.png)",
        "",
        "Frobenius norms of the cross-layer blocks H[blocks.0.a, blocks.1.b] (full Hessian; outer and functional in `report.json`):",
        "",
        "| block 0 \\ block 1 | " + " | ".join(n.removeprefix(block_prefix(1)) for n in b1) + " |",
        "|---|" + "---|" * len(b1),
    ]
    for a in b0:
        lines.append(f"| {a.removeprefix(block_prefix(0))} | "
                     + " | ".join(_fmt(two["norms"]["cross_layer"][f"{a},{b}"]["full"]["fro"]) for b in b1) + " |")
    lines.append("")
    return lines
