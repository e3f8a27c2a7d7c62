r"""The exact Hessian of a model's loss w.r.t. any of its parameters: curvature back-propagation
over the model's stages, cross-layer blocks included (docs/derivations.md §16).

At the output of each stage the walk holds, per sequence, the loss Hessian w.r.t. that level,
:math:`\Psi_k = \partial^2\ell/\partial X_k^2`, and the mixed second derivatives w.r.t. that level
and every later variable, :math:`K_k = \partial^2\ell/\partial X_k\,\partial\theta_{>k}`. A stage
``y = f(x; θ)`` with Jacobians :math:`J_x, J_\theta` and contracted second derivatives ``M`` (w.r.t.
``(x, θ)``, with the gradient at ``y``) then gives

.. math::
    H_{\theta\theta} \mathrel{+}= J_\theta^\top\Psi_k J_\theta + M_{\theta\theta},\qquad
    H_{\theta,\theta_{>k}} \mathrel{+}= J_\theta^\top K_k,

    \Psi_{k-1} = J_x^\top\Psi_k J_x + M_{xx},\qquad
    K_{k-1} = [\,J_x^\top\Psi_k J_\theta + M_{x\theta},\ J_x^\top K_k\,],

every product a vector–Jacobian product of the stage (:mod:`.stages`): nothing is differentiated by
autograd. The outer (Gauss–Newton) part is the same walk with every ``M`` left out; the functional
part starts from :math:`\Psi = 0` at the output and keeps them; both are linear in what they start
from, so they sum to the full Hessian.
"""

from __future__ import annotations

import functools
import math

import torch

from .. import losses
from ..block import pre_ln, select_wrt, work_entries
from ..block.assembled import CHUNK_BYTES, assemble
from ..block.directional import hvp
from ..block.directional import work_entries as directional_work
from ..config import ModelConfig, block_prefix, model_param_shapes, param_shapes
from ..heap import release_free
from ..kronecker import SCRATCH_BYTES
from ..result import BlockSum, HessianBlocks
from ..threads import serial
from ..validation import check_fits, check_result, detached
from .forward_pass import (check_counted, check_model_inputs, last_tokens, model_input, n_tokens, norm_scale, sequence_loss,
                           trace)
from .directional import ModelProduct, fold_tied, unfold_tied
from .stages import (TIED_HEAD, BlockStage, EmbeddingStage, HeadStage, NormStage, OutputLoss, PoolStage,
                     SoftmaxHead)

__all__ = ["ce_tokens", "hessian", "prepare", "stages_of"]


def _fused(cfg: ModelConfig, loss) -> bool:
    """Whether the head and its cross-entropy are taken together (:class:`~.stages.SoftmaxHead`)."""
    return cfg.head is not None and isinstance(loss, str) and loss == "ce"


def _head_names(cfg: ModelConfig) -> tuple[str, ...]:
    return ((TIED_HEAD if cfg.tied else "W_H"),) + (("b_H",) if cfg.head_bias else ())


def ce_tokens(loss, target) -> int | None:
    """The tokens a cross-entropy over the whole batch's ``target`` counts (:func:`blockhess.losses.counted`:
    its mean's ``N``); ``None`` for another loss."""
    return losses.counted(target) if isinstance(loss, str) and loss == "ce" else None


def stages_of(t, loss, target, batch: int, first: int, dense: bool = True, ld: losses.LossDerivatives | None = None,
              tokens: int | None = None):
    """The stages of a forward :class:`~.forward_pass.Trace` ``t``, bottom to top, and the loss on top;
    ``dense=False``: the blocks without the walk's factors (for products; ``t`` may be a plain trace).
    ``ld``: the loss derivatives at ``t.z`` taken already (:func:`_rows` of the call's, for a callable
    loss: it is not called again); else they are taken here from ``loss`` and ``target``. ``tokens``: CE's
    counted tokens of the whole batch (:func:`ce_tokens`; ``None``: ``batch`` times the tokens per sequence)."""
    cfg, p = t.cfg, t.params
    shapes = model_param_shapes(cfg)
    st = []
    emb = tuple(n for n in ("W_E", "b_E", "cls", "W_P", "W_T") if n in shapes)
    if emb:
        st.append(EmbeddingStage(t, emb))
    center = cfg.norm_type == "layer"
    if cfg.embed_norm:
        st.append(NormStage(t.X0, cfg.norm_eps, norm_scale(p, cfg, "E"), p.get("beta_E"),
                            tuple(n for n in ("gamma_E", "beta_E") if n in shapes), center))
    for i, c in enumerate(t.blocks):
        st.append(BlockStage(c, block_prefix(i), dense))
    if cfg.final_norm:
        st.append(NormStage(t.XN, cfg.norm_eps, norm_scale(p, cfg, "F"), p.get("beta_F"),
                            tuple(n for n in ("gamma_F", "beta_F") if n in shapes), center))
    if cfg.pool != "none":
        at = last_tokens(cfg, t.inputs, t.u.shape[1]) if cfg.pool == "last" else None
        st.append(PoolStage(cfg.pool, t.u.shape[1], cfg.d_model, at))
    W = None if cfg.head is None else (p["W_E"].T if cfg.tied else p["W_H"])
    if _fused(cfg, loss):
        B, P = t.h.shape[:2]
        top = SoftmaxHead(t.h, W, p.get("b_H"), target.reshape(B, P), batch * P if tokens is None else tokens,
                          _head_names(cfg))
    else:
        if cfg.head is not None:
            st.append(HeadStage(t.h, W, _head_names(cfg)))
        top = OutputLoss(ld if ld is not None else losses.derivatives(loss, target, t.z, batch=batch, first=first,
                                                                      tokens=tokens))
    return st, top


def _rows(ld: losses.LossDerivatives | None, rows: slice) -> losses.LossDerivatives | None:
    """The derivatives of the sequences ``rows`` of a batch's ``ld`` (views; the batch mean kept), or ``None``."""
    if ld is None:
        return None
    B, P = ld.grad.shape[:2]
    hess = ld.hess.reshape(B, P, *ld.hess.shape[1:])[rows].flatten(0, 1) if ld.per_token else ld.hess[rows]
    return ld._replace(grad=ld.grad[rows], hess=hess)


class _Fold:
    """The walk's blocks into a :class:`BlockSum` over the public names: the tied head's
    :data:`~.stages.TIED_HEAD` ``(d, vocab)`` is ``W_E`` ``(vocab, d)`` transposed, and its blocks
    are added to ``W_E``'s (a pair of the two uses of ``W_E`` to both of its triangles)."""

    def __init__(self, acc: BlockSum, shapes: dict):
        self.acc, self.shapes = acc, shapes

    def _turn(self, name: str, value: torch.Tensor, rows: bool) -> torch.Tensor:
        if name != TIED_HEAD:
            return value
        V, d = self.shapes["W_E"]
        if rows:
            return value.reshape(d, V, -1).transpose(0, 1).reshape(V * d, -1)
        return value.reshape(-1, d, V).transpose(1, 2).reshape(-1, V * d)

    def slot(self, a: str, b: str):
        """:meth:`BlockSum.slot` of a wanted pair where neither is the tied head (whose layout turns), else ``None``."""
        return None if TIED_HEAD in (a, b) or not self.acc.wants(a, b) else self.acc.slot(a, b)

    def add(self, a: str, b: str, value: torch.Tensor) -> None:
        value = self._turn(b, self._turn(a, value, True), False)
        A, B = ("W_E" if a == TIED_HEAD else a), ("W_E" if b == TIED_HEAD else b)
        self.acc.add(A, B, value)
        if A == B and a != b:
            self.acc.add(A, B, value.T)


def _walk(stages, top, wanted: set, outer: bool, functional: bool, acc: _Fold, pairs: bool = True) -> None:
    """Add one pass's Hessian blocks over ``wanted`` (internal names) to ``acc`` (module docstring).

    At the current level ``Psi`` ``(B, m, m)`` and, for each later variable ``u``, its rows of ``K^T``
    ``(B, n_u, m)`` (``later``, a list: each is taken through a stage and dropped in turn, so one
    level's rows are held once); a block with a later variable is one summed vector–Jacobian product
    of its rows (``(n_u, n_v)``, written where it lies, :meth:`~blockhess.result.BlockSum.add`). A
    stage's own variables are taken one at a time, the largest first: ``Psi J_v``, its pairs with
    those taken before (the smaller one's rows through the larger one's factors), its rows one level
    down, then dropped (the stage's curvature first, so that its work space meets none of them).
    ``pairs``: the functional part's blocks among a block's own variables are added here (else by
    :func:`_weight_pairs`, in passes of their own)."""
    Psi, later, H, g = top.start(wanted, outer, functional)
    for (a, b), v in H.items():
        acc.add(a, b, v)
    j0, bottom, G = _bottom_tangents(stages, wanted, acc.acc.sizes)
    if G:
        for u, r in later:  # the bottom variables with the head's: Σ_b G_top^T K_u
            _add_tangent_blocks(acc, bottom, torch.einsum("bmn,bum->nu", G[len(stages) - 1], r), u)
    later = list(later)
    for k in reversed(range(len(stages))):
        st = stages[k]
        here = [n for n in st.names if n in wanted]
        below = any(n in wanted for s in stages[:k] for n in s.names)
        last = not below or bool(G and k == j0)  # no rows go further down (the bottom stages carry tangents up)
        if G and k >= j0 and here:  # the bottom variables with this stage's: Σ_b (Psi G_k)^T J_v
            TPsi = torch.einsum("bmn,bmr->bnr", G[k], Psi)
            for v, val in st.vjps(TPsi, here, summed=True):
                _add_tangent_blocks(acc, bottom, val, v)
            del TPsi
        if here:  # blocks with every later variable u: Σ_b K_u^T J_v, (n_u, n_v), one pair at a time
            for i in range(len(later)):
                u, r = later[i]
                for v, val in st.vjps(r, here, summed=True, into=functools.partial(acc.slot, u)):  # r laid out once
                    if val is not None:  # not written in place
                        acc.add(u, v, val)
                if last:
                    later[i] = (u, None)
                del r
        if last:
            later = []
        XX, Xt = None, {}
        if functional and (below or pairs):
            XX, Xt = st.curv(g, here, acc.acc if pairs else None)
            if G and k >= j0:  # ... and the stage's own cross term: Σ_b G_{k-1}^T M_{xθ}
                for v, M in Xt.items():
                    _add_tangent_blocks(acc, bottom, torch.einsum("bmn,bmq->nq", G[k - 1], M), v)
        PsiJx = st.back(Psi) if below else None  # (B, m, m_in): Psi J_x
        down = []
        order = sorted(here, key=lambda v: -acc.acc.sizes["W_E" if v == TIED_HEAD else v])
        rows = st.vjps(Psi, order)  # rows J_v^T Psi (B, n_v, m): (Psi J_v)^T, Psi symmetric
        lows = None if last else st.vjps(PsiJx.transpose(1, 2), order)
        for i, (v, r) in enumerate(rows):  # the stage's own pairs (v, w), w taken before v: Σ_b J_v^T Psi J_w
            r = r.transpose(1, 2)
            for w, val in st.vjps(r, order[: i + 1], summed=True, into=functools.partial(acc.slot, v)):
                if val is not None:
                    acc.add(v, w, val)
            del r, val
            if not last:  # v's rows one level down, J_v^T Psi J_x + M_vx: the m_in rows of J_x^T Psi through J_v
                D = next(lows)[1]  # (B, m_in, n_v)
                if v in Xt:
                    D += Xt.pop(v)
                down.append((v, D.transpose(1, 2)))
                del D
        del rows, lows
        if isinstance(st, BlockStage):
            st.release()  # its factors: the stages below are walked without them
        if not below:
            return
        Xt = None
        Psi = st.back(PsiJx.transpose(1, 2))  # J_x^T Psi J_x
        del PsiJx
        if XX is not None:
            Psi += XX
        del XX
        while later:  # J_x^T K, one later variable's rows at a time (the old ones dropped as they go)
            u, r = later.pop(0)
            down.append((u, st.back(r)))
            del r
        later = down
        g = st.back(g[:, None])[:, 0]


def _weight_pairs(stages, top, wanted: set, acc: BlockSum) -> None:
    """Add every block's second derivatives among its own variables over ``wanted``, contracted
    with the gradient at its output and summed over the pass's sequences
    (:meth:`~.stages.BlockStage.weight_pairs`), to ``acc``: the functional part's pairs that need
    none of the walk's rows, only the forward pass and the gradient, taken down the stages
    (a block's :meth:`~.stages.BlockStage.grad_in`, no input Jacobian formed)."""
    g = top.gradient()
    first = next((k for k, s in enumerate(stages) if isinstance(s, BlockStage)), len(stages))
    for k in reversed(range(first, len(stages))):
        st = stages[k]
        if isinstance(st, BlockStage):
            st.weight_pairs(g, [n for n in st.names if n in wanted], acc)
            if k > first:
                g = st.grad_in(g.reshape(st.B, st.L, st.d)).reshape(st.B, -1)
        else:
            g = st.back(g[:, None])[:, 0]


def _bottom_tangents(stages, wanted: set, sizes: dict):
    r"""The bottom stages (those below the first block: the embedding and its LayerNorm) carry their
    variables' Jacobians up instead of taking every later variable's ``K`` rows down, where the
    bottom variables are fewer than a sequence's entries at the first block's input (``n_bottom < m``):
    ``(j0, bottom, G)`` with ``j0`` the first block's index, ``bottom`` the wanted bottom variables
    with their sizes (``sizes``: every wanted name's), and ``G[k]`` ``(B, m_k, n_bottom)`` their Jacobian at the output of stage ``k``
    (``k >= j0 - 1``), :math:`G_k = J_{x,k} G_{k-1}`; ``(0, [], {})`` where there is no such stage
    or the rows are the cheaper way.
    A block of a bottom variable with a later one then is :math:`G_k^\top \Psi_k J_v + G_{k-1}^\top M_{xv}`
    (docs/derivations.md §16), at ``n_bottom`` tangents through each stage above instead of ``n_later``
    rows through the first block's ``m × m`` input Jacobian and the (cheap, per-token) bottom stages:
    the tangents cost about ``n_bottom / m`` times the rows' way."""
    j0 = next((k for k, s in enumerate(stages) if isinstance(s, BlockStage)), 0)
    bottom = [n for s in stages[:j0] for n in s.names if n in wanted]
    if not j0 or not bottom or sum(sizes[n] for n in bottom) >= stages[j0].L * stages[j0].d:
        return 0, [], {}
    G, bottom = None, []
    for st in stages[:j0]:
        names = [n for n in st.names if n in wanted]
        if G is not None:
            G = st.fwd(G)
        if names:
            ref = G if G is not None else st.x if isinstance(st, NormStage) else None
            B = st.B if isinstance(st, EmbeddingStage) else st.x.shape[0]
            m = st.L * st.d if isinstance(st, EmbeddingStage) else st.x[0].numel()
            dt = ref.dtype if ref is not None else st.p[names[0]].dtype
            eye = torch.eye(m, dtype=dt, device=st.p[names[0]].device if ref is None else ref.device).expand(B, m, m)
            J = st.vjp(eye, names)  # row r: J^T e_r, the Jacobian's row r
            G = torch.cat(([G] if G is not None else []) + [J[n] for n in names], 2)
            bottom += [(n, J[n].shape[2]) for n in names]
    out = {j0 - 1: G}
    for k in range(j0, len(stages)):
        out[k] = stages[k].fwd(out[k - 1])
    return j0, bottom, out


def _add_tangent_blocks(acc, bottom, value: torch.Tensor, v: str) -> None:
    """Add ``value`` ``(n_bottom, n_v)`` to the blocks of the bottom variables with ``v``."""
    off = 0
    for b, nb in bottom:
        acc.add(b, v, value[off:off + nb])
        off += nb


PASS_BYTES = 64 * 2**20  # the working memory a pass over a chunk of the batch may always use
#: the blocks' weight pairs get passes of their own (:func:`_weight_pairs`) where each takes at least this
#: many times a walk pass's sequences: below it a second contraction per block costs more than it saves
PAIRS_GAIN = 4


def _stage_entries(cfg: ModelConfig, largest: bool = False) -> int:
    """The most entries the variables of one stage have (a block's, or the head's); ``largest``:
    of one variable (every shape of the model)."""
    shapes = model_param_shapes(cfg)
    if largest:
        return max(math.prod(s) for s in shapes.values())
    n = max(sum(math.prod(s) for s in param_shapes(b).values()) for b in cfg.blocks)
    return max(n, cfg.d_model * cfg.n_out if cfg.head is not None else 0)


def _sequence_entries(cfg: ModelConfig, L: int, n: int, loss) -> int:
    """Entries one sequence adds to a walk pass: every block's forward cache and factors with its
    input as a variable and its ``(L·d)²`` input Jacobian (:func:`blockhess.block.work_entries`,
    ``"factors"``; the walk forms one block's factors at a time, so this is more than it holds), the
    largest block's contraction on top (``"hessian"`` less ``"factors"``); the walk's rows at a level,
    ``Ψ``, ``Ψ J_x`` and ``K^T`` (``2m + n`` rows of ``m = L·d``, or the output's ``P·n_out`` at the
    top: each variable's rows are taken down and dropped in turn); one variable's ``J_v^T Ψ`` and
    its rows one level down with the largest stage's ``M_xθ`` (``m`` times the largest variable, and
    twice the largest stage's); the rows' way of a sandwich's scratch (``L`` times the largest
    variable); a callable loss's ``(P·n_out)²`` Hessian twice. Derived here, docs/derivations.md §16."""
    d = cfg.d_model
    P = 1 if cfg.pool != "none" else L
    m = max(L * d, 0 if _fused(cfg, loss) else P * cfg.n_out)  # the widest level the rows reach
    held = [work_entries(b, 1, L, "factors", wrt_input=True) + (L * d) ** 2 for b in cfg.blocks]
    walk = max(work_entries(b, 1, L, "hessian", wrt_input=True) - work_entries(b, 1, L, "factors", wrt_input=True)
               for b in cfg.blocks)
    largest = _stage_entries(cfg, largest=True)
    per = sum(held) + walk + (2 * m + n) * m + (m + L) * largest + 2 * m * _stage_entries(cfg)
    if callable(loss):
        per += 2 * (P * cfg.n_out) ** 2
    return per


def _weight_entries(cfg: ModelConfig, L: int, loss) -> int:
    """Entries one sequence adds to a pass of the blocks' weight pairs (:func:`_weight_pairs`):
    every block's forward cache and factors without its input (:func:`blockhess.block.work_entries`,
    ``"factors"``), the largest block's contraction on top (``"hessian"`` less ``"factors"``), the
    gradient's rows, the rows' way of a sandwich's scratch (``L`` times the largest variable); a
    callable loss's ``(P·n_out)²`` Hessian twice. Derived here, docs/derivations.md §16."""
    P = 1 if cfg.pool != "none" else L
    per = sum(work_entries(b, 1, L, "factors") for b in cfg.blocks)
    per += max(work_entries(b, 1, L, "hessian") - work_entries(b, 1, L, "factors") for b in cfg.blocks)
    per += 4 * L * max(cfg.d_model, cfg.n_out) + L * _stage_entries(cfg, largest=True)
    if callable(loss):
        per += 2 * (P * cfg.n_out) ** 2
    return per


def _fixed_entries(cfg: ModelConfig, n: int, e: int) -> int:
    """Entries a pass holds besides its sequences': the summed product of one variable's rows with
    another's (the largest pair, three times: the product, its layout and the addition), and the
    scratch of the blocks' sandwiches written into the result (:meth:`~blockhess.result.BlockSum.write_sandwich`:
    ``SCRATCH_BYTES`` of ``e``-byte entries, or a Khatri–Rao block of the largest pair; the rows' way
    is in :func:`_sequence_entries`)."""
    largest = _stage_entries(cfg, largest=True)
    return 4 * largest ** 2 + SCRATCH_BYTES // e


def _chunks(cfg: ModelConfig, B: int, L: int, n: int, loss, e: int) -> tuple[list[slice], list[slice]]:
    """The batch's sequences, one slice per pass: ``(walk, pairs)``. The walk's passes take as many
    as fit in ``PASS_BYTES`` or half the dense result, whichever is more (:func:`_sequence_entries`);
    the blocks' weight pairs' as many as fit in what one walk pass may hold (:func:`_weight_entries`),
    so that they raise no peak, where that is at least ``PAIRS_GAIN`` times a walk pass's sequences
    (else ``[]``: the walk's passes add those pairs, in the contraction they make anyway)."""
    room = max(PASS_BYTES, n * n * e // 2) // e - _fixed_entries(cfg, n, e)
    size = max(1, min(B, int(room // _sequence_entries(cfg, L, n, loss))))
    pairs = max(1, min(B, size * _sequence_entries(cfg, L, n, loss) // _weight_entries(cfg, L, loss)))
    return ([slice(s, min(s + size, B)) for s in range(0, B, size)],
            [slice(s, min(s + pairs, B)) for s in range(0, B, pairs)] if pairs >= PAIRS_GAIN * size else [])


@serial()
def _passes(params, inputs, cfg, loss, target, names, chunks, which: str, like, parts=None, ld=None) -> HessianBlocks:
    """``chunks``: ``(walk, pairs)``, the slices of the walk's passes (:func:`_sequence_entries`) and
    of the blocks' weight pairs' (:func:`_weight_entries`; the functional part's only; ``[]``: the
    walk adds them). ``ld``: a callable loss's derivatives over the whole batch, taken at the call
    (each pass takes its rows; the loss is not called), else ``None``."""
    shapes = model_param_shapes(cfg)
    wanted = set(names)
    if cfg.tied and "W_E" in wanted:
        wanted.add(TIED_HEAD)
    B = len(inputs)
    tokens = ce_tokens(loss, target)
    acc = BlockSum(names, shapes, dense=True, dtype=like.dtype, device=like.device)
    fold = _Fold(acc, shapes)
    walk_chunks, pair_chunks = chunks
    if pair_chunks and which in ("full", "functional"):
        for rows in pair_chunks:
            t = trace(params, inputs[rows], cfg, first=rows.start, wrt_input=False)
            tg = target[rows] if isinstance(target, torch.Tensor) else target
            st, top = stages_of(t, loss, tg, B, rows.start, dense=False, ld=_rows(ld, rows), tokens=tokens)
            _weight_pairs(st, top, wanted, acc)
            del t, st, top
        acc.free_scratch()  # the walk's passes write no sandwiches
    for rows in walk_chunks:
        t = trace(params, inputs[rows], cfg, first=rows.start)
        tg = target[rows] if isinstance(target, torch.Tensor) else target
        st, top = stages_of(t, loss, tg, B, rows.start, ld=_rows(ld, rows), tokens=tokens)
        _walk(st, top, wanted, which in ("full", "outer"), which in ("full", "functional"), fold, pairs=not pair_chunks)
        del t, st, top  # a pass's trace and stages go before the next pass's are built
    release_free()  # the passes' work space, before the result's last pages are first written (blockhess.heap)
    for name in names:  # each diagonal block is a sum of symmetric terms: its rounding mirrored too
        acc.symmetrise(name)
    H = acc.result(like, cfg, parts)
    check_result({f"the Hessian{'' if which == 'full' else ' ' + which + ' part'}": H.dense()})
    return H


def prepare(params: dict, inputs, cfg: ModelConfig, loss, target, wrt):
    """The checked call: ``(params, inputs, loss, target, names, t)`` with copies of ``params``, the
    batched ``inputs`` and a tensor ``target`` (a snapshot: nothing the caller changes in place after
    the call reaches what is computed from them; docs/models.md, "A snapshot of the call"), the loss and target as :mod:`blockhess.losses` takes them on the
    output ``(B, P, n_out)`` (:func:`~.forward_pass.sequence_loss`), the ``wrt`` names in canonical order,
    and the plain forward trace ``t`` (every LayerNorm row checked before any derivative). Raises
    ``ValueError`` as :func:`hessian`."""
    inputs, single = model_input(cfg, inputs)
    check_model_inputs(params, inputs, cfg)
    names = select_wrt(tuple(model_param_shapes(cfg)), wrt)
    params, _, target = detached(params, params[names[0]], target)
    params = {k: v.clone() for k, v in params.items()}
    inputs = inputs.clone()
    t = trace(params, inputs, cfg, derivatives=False)
    if single and isinstance(target, torch.Tensor):  # one sequence's target gets the batch axis (any loss)
        target = target[None]
    loss, target = sequence_loss(cfg, loss, target, t.z)
    target = losses.check(loss, target, t.z, ignore=True)
    check_counted(cfg, inputs, loss, target)
    if isinstance(target, torch.Tensor):  # a copy too: labels reused in place for the next batch change nothing
        target = target.clone()
    return params, inputs, loss, target, names, t


#: what :func:`hessian`'s ``part`` computes: the Hessian (its parts on first access) or one part alone
PARTS = ("full", "outer", "functional")


def hessian(params: dict, inputs, cfg: ModelConfig, loss="ce", target=None, wrt=None, part: str = "full") -> HessianBlocks:
    r"""The exact Hessian of a model's loss w.r.t. its parameters (``wrt``: a subset), by curvature
    back-propagation in closed form (module docstring; :func:`blockhess.hessian` for a model).

    ``inputs``: what the model takes first (:func:`~.forward_pass.check_model_inputs`), a batch or one
    sequence, or the forward's keyword arguments as a dict (:func:`~.forward_pass.model_input`:
    ``attention_mask``, ``position_ids``, ``token_type_ids``; docs/derivations.md §22). ``loss``:
    ``"ce"`` (pooled: classes ``(B,)``; per token: ``(B, L)``, no shift; targets of -100 ignored),
    ``"mse"`` (mean over the output's entries; target shaped as the output) or a callable on one
    sequence's output as the model returns it (``(n_out,)`` pooled, ``(L, n_out)`` per token); the
    batch loss is the mean over sequences (CE: over the batch's counted tokens). Returns a
    :class:`~blockhess.result.HessianBlocks` over the public names in canonical order, dtype and device
    of the parameters, ``.outer`` and ``.functional`` on first access (their own passes) from a
    snapshot of the call: copies of ``params``, ``inputs`` and ``target``, and a callable loss's
    gradient and Hessian w.r.t. the output taken at the call, ``(B, P·n_out)`` and
    ``(B, P·n_out, P·n_out)``, held with the result (the callable is not called again: what it closes
    over, a head's weights, may change after the call). A parameter used twice (the tied ``W_E``) has
    both uses.

    Raises ``ValueError`` on bad inputs (:func:`~.forward_pass.model_input`,
    :func:`~.forward_pass.check_model_inputs`), a target of the wrong shape or class range, labels that
    count no token, a counted token that attends to nothing (:func:`~.forward_pass.check_counted`), an unknown ``wrt`` name, a LayerNorm input row it cannot take, an
    overflow; a callable loss's NaN or Inf value, gradient or Hessian (:func:`blockhess.losses.derivatives`);
    ``InsufficientMemoryError`` before any pass if the ``n × n`` result, or it with a callable loss's
    ``B`` Hessians and the largest pass (:func:`_sequence_entries`), would not fit.

    ``part``: ``"full"`` (the Hessian, its parts on first access), or ``"outer"`` (the Gauss–Newton matrix) or
    ``"functional"`` alone: only that part's passes, a result without parts (what :func:`blockhess.hessian`'s
    ``.outer`` computes, without the full Hessian's passes first); ``ValueError`` for another value, before any
    work.

    Blocks with :attr:`~blockhess.config.BlockConfig.llama_options` (RMSNorm, the gated FFN, grouped-query
    attention, RoPE, ...) have no Kronecker factors for the walk: the Hessian is then assembled column block
    by column block from the model's exact products (:func:`_assembled`), the same result type and split.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if any(b.llama_options for b in getattr(cfg, "blocks", ())):  # the walk composes the blocks' Kronecker factors
        return _assembled(params, inputs, cfg, loss, target, wrt, part)
    params, inputs, loss, target, names, t = prepare(params, inputs, cfg, loss, target, wrt)
    z, t = t.z, None  # the output, for a callable loss's derivatives; the rest of the plain trace goes
    shapes = model_param_shapes(cfg)
    like = params[names[0]]
    B = len(inputs)
    e = like.element_size()
    n = sum(math.prod(shapes[k]) for k in names)
    L = n_tokens(cfg, inputs)
    chunks = _chunks(cfg, B, L, n, loss, e)
    rows = max(len(range(B)[c]) for c in chunks[0])  # the pairs' passes hold no more than the walk's
    held = B * z[0].numel() ** 2 if callable(loss) else 0  # a callable's (P·n_out)² Hessians, kept for the parts
    need = (n * n + held + _fixed_entries(cfg, n, e) + rows * _sequence_entries(cfg, L, n, loss)) * e
    what = f"the dense {n}x{n} Hessian"
    check_fits(n * n * e, what, like.device)
    check_fits(need, f"{what}{' and the loss Hessians of the batch' if held else ''} with a pass of the closed form "
               f"over {rows} sequence{'s' if rows > 1 else ''} of {L} tokens", like.device)
    # a callable loss may close over tensors the caller changes after the call (a head an optimizer steps):
    # its derivatives are taken once, here, and every pass (the parts' later ones too) takes its rows of them
    ld = losses.derivatives(loss, target, z, batch=B) if callable(loss) else None
    del z

    def of_part(which: str) -> HessianBlocks:
        check_fits(need, f"the {which} part of the Hessian ({n}x{n}) with a pass", like.device)
        return _passes(params, inputs, cfg, loss, target, names, chunks, which, like, ld=ld)

    if part != "full":
        return of_part(part)
    return _passes(params, inputs, cfg, loss, target, names, chunks, "full", like, parts=of_part, ld=ld)


def _product_entries(cfg: ModelConfig, B: int, L: int) -> int:
    """Entries one direction of a model's product holds (:class:`~.directional.ModelProduct`): every block's
    tangents and adjoints at once (the pass up recurses through the blocks above,
    :func:`blockhess.block.directional.work_entries` each), the top's rows (the output's and ``d``-wide ones,
    a few of each) and four copies of the model's weights (the direction, the rows and their layouts)."""
    n = sum(math.prod(s) for s in model_param_shapes(cfg).values())
    blocks = sum(directional_work(b, B, L, 1) for b in cfg.blocks)
    return blocks + B * L * (4 * cfg.d_model + 3 * cfg.n_out) + 4 * n


#: a pre-LN block's variables by the layer they enter at, bottom to top: LN_1, the attention with W_O, LN_2, the FFN
_PRE_LN_LAYERS = (("gamma_1", "beta_1"), ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_O", "b_O"), ("gamma_2", "beta_2"),
                  ("W_G", "b_G", "W_1", "b_1", "W_2", "b_2"))


def _forward_order(names, cfg: ModelConfig) -> tuple[str, ...]:
    """``names`` (canonical order) with each pre-LN block's variables in the order its layers run
    (:data:`_PRE_LN_LAYERS`: LN_1's scale first, LN_2's before the FFN; the canonical order lists them after
    their sub-layer, as post-LN runs); every other name where it is. The dense assembly takes its columns
    so (:func:`blockhess.block.assembled.assemble`'s ``order``): a chunk of a layer's columns then asks for
    the rows of that layer and the ones above, and the pass back stops at it."""
    out = list(names)
    for i, b in enumerate(getattr(cfg, "blocks", ())):
        if not pre_ln(b):
            continue
        p = block_prefix(i)
        mine = [k for k in out if k.startswith(p)]
        if not mine:
            continue
        ranked = sorted(mine, key=lambda k: next((j for j, layer in enumerate(_PRE_LN_LAYERS) if k[len(p):] in layer), 1))
        at = out.index(mine[0])
        out[at:at + len(mine)] = ranked  # a block's names are consecutive in the canonical order
    return tuple(out)


def _assembled(params: dict, inputs, cfg: ModelConfig, loss, target, wrt, part: str = "full") -> HessianBlocks:
    r""":func:`hessian` for a model whose blocks have :attr:`~blockhess.config.BlockConfig.llama_options`:
    column ``j`` is the model's exact product :math:`H e_j` (:class:`~.directional.ModelProduct`, the
    engine of :func:`blockhess.hessian_operator`: tangents up the stages, second-order adjoints down, no
    autograd), ``k`` columns at a time (:data:`blockhess.block.assembled.CHUNK_BYTES`,
    :func:`_product_entries`), each product forming only the rows of the chunk's variable and the later
    ones (restricted: the tangents start at the chunk's stage, the adjoints stop there), written into the
    block lower triangle of the ``n × n`` result and mirrored (:func:`blockhess.block.assembled.assemble`). ``.outer`` and ``.functional`` by their own products
    (the output's loss Hessian kept, the second-order terms dropped; and the reverse), so
    ``outer + functional == full`` is a check; ``part`` other than ``"full"``: that part's products alone. The tied
    ``W_E``'s two uses are summed in each product.
    Raises as :func:`hessian`; ``InsufficientMemoryError`` before any product if the result, its
    symmetrising temporary and one product's working set would not fit."""
    params, inputs, loss, target, names, t = prepare(params, inputs, cfg, loss, target, wrt)
    shapes = model_param_shapes(cfg)
    like = params[names[0]]
    B, L, e = len(inputs), n_tokens(cfg, inputs), like.element_size()
    sizes = {k: math.prod(shapes[k]) for k in names}
    n = sum(sizes.values())
    per = _product_entries(cfg, B, L)
    step = max(1, min(n, CHUNK_BYTES // (per * e)))
    what = f"the dense {n}x{n} Hessian"
    check_fits(n * n * e, what, like.device)
    need = (2 * n * n + step * (per + 2 * n)) * e
    check_fits(need, f"{what} from {n} exact products of the model, {step} at a time", like.device)
    ld = losses.derivatives(loss, target, t.z, batch=B) if callable(loss) else None  # taken once, at the call
    st, top = stages_of(t, loss, target, B, 0, dense=False, ld=ld, tokens=ce_tokens(loss, target))
    del t
    prod = ModelProduct(st, top, cfg.d_model, hvp)
    internal = dict(shapes, **({TIED_HEAD: shapes["W_E"][::-1]} if cfg.tied else {}))

    def matrix(which: str) -> torch.Tensor:
        outer, functional = which in ("full", "outer"), which in ("full", "functional")

        def product(V, rows):  # the rows of the chunk's variables and the later ones: the products restricted
            k = next(iter(V.values())).shape[0]
            V = fold_tied({m: v.reshape(k, *shapes[m]) for m, v in V.items()}, internal)
            rows = tuple(rows) + ((TIED_HEAD,) if cfg.tied and "W_E" in rows else ())
            return unfold_tied(prod(V, rows, outer=outer, functional=functional))

        return assemble(product, names, sizes, like, step, lower=True, order=_forward_order(names, cfg))

    def of_part(which: str) -> HessianBlocks:
        check_fits(need, f"the {which} part of the Hessian ({n}x{n}) from exact products", like.device)
        H = HessianBlocks.from_buffer(names, shapes, matrix(which), cfg=cfg)
        check_result({f"the Hessian's {which} part": H.dense()})
        return H

    if part != "full":
        return of_part(part)
    H = HessianBlocks.from_buffer(names, shapes, matrix("full"), of_part, cfg=cfg)
    check_result({"the Hessian": H.dense()})
    return H
