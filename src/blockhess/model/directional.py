r"""A model's exact Hessian–vector products, matrix-free: a tangent pass up the stages and a
second-order adjoint pass down (docs/derivations.md §16, "Products").

For directions ``V`` (``k`` of them at once), stage ``k`` maps its input tangent :math:`\dot x` and its
variables' directions :math:`\dot\theta` to its output tangent :math:`\dot y = J_x\dot x + J_\theta\dot\theta`
(``tangent``); at the top the loss Hessian gives :math:`\dot g_z = \nabla^2_z\ell\,\dot z` (outer part;
``0`` for the functional part); each stage then returns the adjoint tangent at its input and its
variables' rows of :math:`Hv` (``adjoint2``: :math:`J^\top\dot g` plus, for the functional part, its
second derivatives contracted with its gradient along :math:`(\dot x, \dot\theta)`). A block does
both in one call (:func:`blockhess.block.directional.hvp`), with the stages above it as its
``omega``. The forward pass and the gradient at every level are kept and reused by every product.
"""

from __future__ import annotations

import torch

from ..block.directional import adjoints, vjp
from .stages import TIED_HEAD, BlockStage, EmbeddingStage, SoftmaxHead

__all__ = ["ModelProduct"]


class ModelProduct:
    """The products of one batch's Hessian: ``stages`` (bottom to top, :func:`~.walk.stages_of`) and
    the loss ``top``; ``block_hvp`` the block's product (:func:`blockhess.block.directional.hvp`).

    ``self(V, names, outer, functional)`` takes ``{name: (k, *shape)}`` over internal variable names
    (a missing direction is zero; at least one present) and returns the rows of ``H V`` for ``names``,
    exactly those (a name not asked has no entry). Restricted (docs/derivations.md §18, "Restricted
    products"): the tangent pass starts at the lowest stage ``s0`` holding a direction (below it
    every tangent is zero, and nothing runs there on the way up), the adjoint pass stops at the lowest
    stage ``s1`` holding a wanted name, and each block forms only its wanted rows
    (``block_hvp(..., wanted=...)``); between ``s1`` and ``s0`` the pass back is the stages' plain
    adjoints (a block's :func:`blockhess.block.directional.vjp`: no tangent, no second-order term).
    ``into``: name → a destination for that variable's rows, passed to the blocks
    (:func:`blockhess.block.directional.hvp`'s ``into``); a row written there is returned as that tensor."""

    def __init__(self, stages, top, d_model: int, block_hvp):
        self.stages = list(stages) + ([top.head()] if isinstance(top, SoftmaxHead) else [])
        self.top, self.block_hvp = top, block_hvp
        g = top.g if isinstance(top, SoftmaxHead) else top.ld.grad  # (B, P, C) at the output
        self.grads = [None] * len(self.stages)  # the gradient at each stage's output
        self.adj = {}  # each block's first-order adjoints of its output gradient, once (functional terms)
        for k in reversed(range(len(self.stages))):
            self.grads[k] = g
            st = self.stages[k]
            if isinstance(st, BlockStage):
                self.adj[k] = adjoints(st.c, g)
                if k:  # pre-LN: the adjoints hold the gradient at the input already
                    g = self.adj[k].gX if self.adj[k].gX is not None else st.grad_in(g)
            elif k and st.back is not None:
                B = g.shape[0]
                g = st.back(g.reshape(B, 1, -1))[:, 0].reshape(B, -1, d_model)

    def __call__(self, V: dict, names, outer: bool = True, functional: bool = True, into=None) -> dict:
        return self.columns([(V, names)], outer, functional, [into])[0]

    def expect(self, columns: int) -> None:
        """A hint that at least ``columns`` more columns carrying no direction of the head's own variables will
        be multiplied: passed to a softmax head (:meth:`~.stages.SoftmaxHead.expect`); nothing else uses it."""
        if isinstance(self.top, SoftmaxHead):
            self.top.expect(columns)

    def columns(self, groups, outer: bool = True, functional: bool = True, into=None) -> list[dict]:
        """The products of several groups of directions in one pass: ``groups`` a sequence of ``(V, names)``
        (each as for ``self(V, names)``, with its own ``k``), ``into`` ``None`` or one destination dict (or
        ``None``) per group. Returns one dict of rows per group, each exactly ``self(V, names)``.

        The groups share the passes (docs/derivations.md §18, "Products of several groups"): a group's
        tangent starts at its lowest stage holding a direction, and every group running through a stage goes
        through it in one call with the others that have no direction and no wanted row there (their tangents
        stacked); a group with a direction or a wanted row at a stage has its own call there (only its rows
        formed), the calls of one block nested through their ``omega`` so that the stages above run once for
        all of them. A group's pass back stops at its lowest wanted row; below its lowest direction it is the
        plain adjoints."""
        G = len(groups)
        into = [i or {} for i in (into or [None] * G)]
        Vs = [V for V, _ in groups]
        wanted = [set(w) for _, w in groups]
        ks = [next(iter(V.values())).shape[0] for V in Vs]
        outs: list[dict] = [{} for _ in range(G)]
        n = len(self.stages)
        s0 = [next((k for k, st in enumerate(self.stages) if any(m in V for m in st.names)), None) for V in Vs]
        s1 = [next((k for k, st in enumerate(self.stages) if any(m in w for m in st.names)), None) for w in wanted]
        for g in range(G):
            if s0[g] is None or s1[g] is None:
                raise ValueError(f"the product needs a direction and a wanted row among the stages' variables; "
                                 f"got directions {sorted(Vs[g])} and rows {sorted(wanted[g])}")

        def local(st, here):
            p = len(st.prefix)
            return {m[p:] for m in here}

        def stage_into(st, g):
            """A stage's destinations: the head's own; the token embedding's W_E the tied head's rows (to be added
            to) or ``into``'s, zeroed (the tied head's are then never in the rows on their own)."""
            if isinstance(st, EmbeddingStage) and "W_E" in st.names:
                acc = outs[g].pop(TIED_HEAD, None)
                if acc is None and "W_E" in into[g]:
                    acc = into[g]["W_E"].zero_()
                return None if acc is None else {"W_E": acc}
            return {m: into[g][m] for m in st.names if m in into[g]}

        def calls_at(st, k, items):
            """The calls of stage ``k`` for the groups ``items`` ``[(g, dx)]`` running through it: ``(gs, dx,
            directions, rows wanted, input adjoint wanted)``; a group with a direction or a row here alone,
            the others stacked by whether the pass back goes below."""
            calls, through = [], {True: [], False: []}
            for g, dx in items:
                Vk = {m: Vs[g][m] for m in st.names if m in Vs[g]}
                here = [m for m in st.names if m in wanted[g]]
                if Vk or here:
                    calls.append(([g], dx, Vk, here, s1[g] < k))
                else:
                    through[s1[g] < k].append((g, dx))
            for below, its in through.items():
                if its:
                    calls.append(([g for g, _ in its], torch.cat([dx for _, dx in its]), {}, [], below))
            return calls

        def split(t, gs) -> list:
            return list(torch.split(t, [ks[g] for g in gs])) if len(gs) > 1 else [t]

        def adjoint_of(held, gs, like):
            """The adjoint tangents from above of the groups ``gs``, stacked (zeros for a group whose pass back
            ends above: unread)."""
            parts = [held[g] if g in held else like.new_zeros(ks[g], *like.shape[1:]) for g in gs]
            return torch.cat(parts) if len(parts) > 1 else parts[0]

        def up(k: int, calls: list, dys: list, held: dict) -> list:
            """The adjoint tangents at stage ``k``'s output of its calls' output tangents ``dys``: the loss's
            Hessian applied to each call's directly above the last stage (per row: no stacking needed), else
            the stages above, by :func:`run`, for every call's groups at once (their rows into ``held``)."""
            if k + 1 == n:
                return [self.top.omega(dy) if outer else torch.zeros_like(dy) for dy in dys]
            held.update(run(k + 1, [(g, t) for (gs, *_), dy in zip(calls, dys) for g, t in zip(gs, split(dy, gs))]))
            return [adjoint_of(held, gs, dy) for (gs, *_), dy in zip(calls, dys)]

        def run(k: int, items: list) -> dict:
            """Stage ``k`` (``k < n``: the loss is applied by :func:`up`) for the groups ``items`` ``[(g, dx)]``
            whose tangent has reached it (``dx`` its input tangent) and those starting here, the stages above by
            recursion; returns ``{g: the adjoint tangent at its input}`` for the groups with a wanted row below."""
            items = items + [(g, None) for g in range(G) if s0[g] == k]
            st = self.stages[k]
            calls = calls_at(st, k, items)
            found: dict = {}
            held: dict = {}
            if isinstance(st, BlockStage):
                p = len(st.prefix)
                results: list = [None] * len(calls)
                dgs: list = []

                def nest(i: int, dZs: list) -> None:
                    """Call ``i`` of this block, its ``omega`` running the next call (the last: the stages
                    above, once for every call's tangent)."""
                    if i == len(calls):
                        dgs[:] = up(k, calls, dZs, held)
                        return
                    gs, dx, Vk, here, below = calls[i]

                    def omega(dZ):
                        nest(i + 1, dZs + [dZ])
                        return dgs[i]

                    dest = into[gs[0]] if len(gs) == 1 else {}
                    results[i] = self.block_hvp(st.c, self.adj[k] if functional else None,
                                                {m[p:]: v for m, v in Vk.items()}, omega=omega, dX=dx, outer=True,
                                                functional=functional, input_adjoint=below, wanted=local(st, here),
                                                into={m[p:]: t for m, t in dest.items() if m in st.names})

                try:
                    if calls:
                        nest(0, [])
                    else:
                        held.update(run(k + 1, []))
                finally:
                    nest = None  # nest refers to itself: a cycle holding the calls' tangents until the cyclic GC
                for (gs, *_, below), (HV, dg) in zip(calls, results):
                    if HV:
                        outs[gs[0]].update({st.prefix + m: v for m, v in HV.items()})
                    if below:
                        found.update(zip(gs, split(dg, gs)))
            else:
                if k + 1 == n and isinstance(self.top, SoftmaxHead):  # the head's own pass for plain tangents
                    plain = [c for c in calls if not c[2] and not c[3]]
                    calls = [c for c in calls if c[2] or c[3]]
                    for gs, dx, _, _, below in plain:
                        if below:
                            found.update(zip(gs, split(self.top.through(dx) if outer else torch.zeros_like(dx), gs)))
                dys = [st.tangent(dx, Vk, sum(ks[g] for g in gs)) for gs, dx, Vk, _, _ in calls]
                dgs = up(k, calls, dys, held)
                for (gs, dx, Vk, here, below), dg_out in zip(calls, dgs):
                    if not (below or here):
                        continue
                    dg_in, HV = st.adjoint2(self.grads[k], dx, Vk, dg_out, here, functional,
                                            into=stage_into(st, gs[0]) if here else None)
                    if here:
                        outs[gs[0]].update(HV)
                    if below:
                        found.update(zip(gs, split(dg_in, gs)))
            for g in [g for g in held if s0[g] > k]:  # below the group's directions: the plain adjoints
                here = [m for m in st.names if m in wanted[g]]
                if isinstance(st, BlockStage):
                    HV, dg = vjp(st.c, held[g], wanted=local(st, here), input_adjoint=k > s1[g])
                    outs[g].update({st.prefix + m: v for m, v in HV.items()})
                else:
                    dg, HV = st.adjoint2(self.grads[k], None, {}, held[g], here, functional, into=stage_into(st, g))
                    outs[g].update(HV)
                if k > s1[g]:
                    found[g] = dg
            return found

        try:
            run(min(min(s0), min(s1)), [])
            return outs
        finally:  # run and up refer to each other: a cycle that would hold the directions, the rows and every
            run = up = None  # stage's tangents of this product until the cyclic GC ran (GBs over a lock-step run)


def fold_tied(V: dict, shapes: dict) -> dict:
    """Directions over public names -> internal ones: the tied ``W_E``'s second use gets ``W_E``'s, in
    ``W_E``'s layout (:class:`~.stages.HeadStage`'s products take the tied head's direction so)."""
    if "W_E" in V and TIED_HEAD in shapes:
        V = {**V, TIED_HEAD: V["W_E"]}
    return V


def unfold_tied(HV: dict) -> dict:
    """Rows over internal names -> public ones: the two uses of ``W_E`` summed (both in ``W_E``'s layout,
    each a fresh tensor of the product's, so the sum is taken in place)."""
    if TIED_HEAD in HV:
        HV = dict(HV)
        extra = HV.pop(TIED_HEAD)
        HV["W_E"] = HV["W_E"].add_(extra) if "W_E" in HV else extra
    return HV
