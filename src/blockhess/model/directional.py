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
                if k:
                    g = st.grad_in(g)
            elif k and st.back is not None:
                B = g.shape[0]
                g = st.back(g.reshape(B, 1, -1))[:, 0].reshape(B, -1, d_model)

    def __call__(self, V: dict, names, outer: bool = True, functional: bool = True, into=None) -> dict:
        out: dict = {}
        into = into or {}
        wanted = set(names)
        k_dirs = next(iter(V.values())).shape[0]
        n = len(self.stages)
        s0 = next((k for k, st in enumerate(self.stages) if any(m in V for m in st.names)), None)
        s1 = next((k for k, st in enumerate(self.stages) if any(m in wanted for m in st.names)), None)
        if s0 is None or s1 is None:
            raise ValueError(f"the product needs a direction and a wanted row among the stages' variables; "
                             f"got directions {sorted(V)} and rows {sorted(wanted)}")

        def local(st, here):
            p = len(st.prefix)
            return {m[p:] for m in here}

        def stage_into(st):
            """A stage's destinations: the head's own; the token embedding's W_E the tied head's rows (to be added
            to) or ``into``'s, zeroed (the tied head's are then never in ``out`` on their own)."""
            if isinstance(st, EmbeddingStage) and "W_E" in st.names:
                acc = out.pop(TIED_HEAD, None)
                if acc is None and "W_E" in into:
                    acc = into["W_E"].zero_()
                return None if acc is None else {"W_E": acc}
            return {m: into[m] for m in st.names if m in into}

        def run(k: int, dx):
            """Stage ``k`` (``k >= s0``) along the input tangent ``dx`` (``None``: zero), the stages above
            by recursion; returns the adjoint tangent at its input, or ``None`` when no stage below is wanted."""
            if k == n:
                return self.top.omega(dx) if outer else torch.zeros_like(dx)
            st = self.stages[k]
            Vk = {m: V[m] for m in st.names if m in V}
            here = [m for m in st.names if m in wanted]
            below = k > s1
            if isinstance(st, BlockStage):
                p = len(st.prefix)
                HV, dg = self.block_hvp(st.c, self.adj[k] if functional else None, {m[p:]: v for m, v in Vk.items()},
                                        omega=lambda dZ: run(k + 1, dZ), dX=dx, outer=True, functional=functional,
                                        input_adjoint=below, wanted=local(st, here),
                                        into={m[p:]: t for m, t in into.items() if m in st.names})
                out.update({st.prefix + m: v for m, v in HV.items()})
                return dg
            dy = st.tangent(dx, Vk, k_dirs)
            dg_out = run(k + 1, dy)
            if not (below or here):
                return None
            dg_in, HV = st.adjoint2(self.grads[k], dx, Vk, dg_out, here, functional, into=stage_into(st))
            out.update(HV)
            return dg_in if below else None

        dg = run(s0, None)
        for k in reversed(range(s1, s0)):  # below every direction: the plain adjoints, no tangent
            st = self.stages[k]
            here = [m for m in st.names if m in wanted]
            if isinstance(st, BlockStage):
                HV, dg = vjp(st.c, dg, wanted=local(st, here), input_adjoint=k > s1)
                out.update({st.prefix + m: v for m, v in HV.items()})
            else:
                dg, HV = st.adjoint2(self.grads[k], None, {}, dg, here, functional, into=stage_into(st))
                out.update(HV)
        return out


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
