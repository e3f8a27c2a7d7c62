"""How a module's stored tensors hold this library's parameters, and the two maps between them.

A reader (:mod:`.torch`, :mod:`.hf`) describes a module by its config and a *spec*: for each of the
module's parameter names a :class:`Stored`, the parameters of ours that tensor holds and how (each
transposed or not, stacked along one axis, the result reshaped to the stored shape). Every stored
tensor is a permutation of the entries of its parts, so the same :meth:`Stored.join` that would
build it from our tensors builds, from integer index tensors, the permutation between the two
layouts (:func:`positions`), which relabels a Hessian (:func:`relabel`) and an operator's vectors
(:func:`blockhess.adapters.operator_to_module`). :func:`read` applies :meth:`Stored.split` the other way.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..config import BlockConfig, ModelConfig, model_param_shapes, param_shapes
from ..result import HessianBlocks
from ..validation import FLOAT_DTYPES, check_fits

__all__ = ["Stored", "shapes_of", "read", "positions", "relabel", "structure"]


@dataclasses.dataclass(frozen=True)
class Stored:
    """One stored tensor of a module: ``names``, the parameters of ours it holds, in stacking order
    (``()``: a parameter our model does not use, such as BERT's pooler, whose Hessian blocks are
    zero), each stored as its transpose when ``transposed`` (``nn.Linear``'s ``(out, in)``), stacked
    along ``axis`` (``in_proj_weight``: 0, GPT-2's fused ``c_attn``: 1), then reshaped to the stored
    shape (a ``Conv2d`` kernel ``(d, C, p, p)``, ViT's ``cls_token`` ``(1, 1, d)``)."""

    names: tuple = ()
    axis: int = 0
    transposed: bool = False

    def _parts(self, shapes: dict) -> list[tuple]:
        return [tuple(shapes[n])[::-1] if self.transposed else tuple(shapes[n]) for n in self.names]

    def joined_shape(self, shapes: dict) -> tuple:
        """The shape of the stacked parts before the reshape to the stored shape."""
        parts = self._parts(shapes)
        out = list(parts[0])
        out[self.axis] = sum(p[self.axis] for p in parts)
        return tuple(out)

    def join(self, ours: dict, shape) -> torch.Tensor:
        """The stored tensor of ``shape`` from our tensors ``ours`` (any dtype: integer index tensors too)."""
        return torch.cat([ours[n].T if self.transposed else ours[n] for n in self.names], self.axis).reshape(shape)

    def split(self, stored: torch.Tensor, shapes: dict) -> dict:
        """Our tensors (views of ``stored``) of the shapes ``shapes``; the inverse of :meth:`join`."""
        parts = self._parts(shapes)
        chunks = stored.reshape(self.joined_shape(shapes)).split([p[self.axis] for p in parts], self.axis)
        return {n: c.T if self.transposed else c for n, c in zip(self.names, chunks)}


def shapes_of(cfg) -> dict:
    """Our parameter names and shapes for a :class:`BlockConfig` or a :class:`ModelConfig`."""
    return model_param_shapes(cfg) if isinstance(cfg, ModelConfig) else param_shapes(cfg)


def _what(module) -> str:
    return type(module).__name__


def read(module: torch.nn.Module, cfg, spec: dict, dtype=None) -> dict:
    """``params`` of ``cfg`` from ``module``'s parameters by ``spec``: detached, contiguous copies,
    canonical order, in ``dtype`` if given, else the module's.

    Raises ``ValueError`` naming the module and the parameters if the module has a parameter
    ``spec`` does not describe (something the closed form would leave out), if ``cfg`` needs a
    parameter no stored tensor holds, or if a stored tensor's shape does not match ``cfg``'s.
    """
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"from_torch: dtype must be float32 or float64, got {dtype}")
    shapes = shapes_of(cfg)
    named = dict(module.named_parameters())
    unknown = [n for n in named if n not in spec]
    if unknown:
        raise ValueError(f"{_what(module)}: cannot read parameter(s) {unknown}: they are not part of the architecture "
                         "from_torch reads (docs/models.md)")
    params = {}
    for mname, s in spec.items():
        if not s.names:
            continue
        t = named[mname].detach()
        want = s.joined_shape(shapes)
        if t.numel() != math.prod(want):
            raise ValueError(f"{_what(module)}: {mname} has shape {tuple(t.shape)}, expected {want} "
                             f"(holding {', '.join(s.names)})")
        for n, v in s.split(t, shapes).items():
            params[n] = v.to(dtype or v.dtype).clone().contiguous()
    missing = [n for n in shapes if n not in params]
    if missing:
        raise ValueError(f"{_what(module)}: no parameter holds {missing}, which the closed form of {cfg} needs")
    return {n: params[n] for n in shapes}


def structure(cfg):
    """``cfg`` with what does not change the parameters' meaning made equal: the mask, ``d_k`` left
    to its default, ``d_ff`` of the bare attention layer (unused); a model's blocks likewise."""
    if isinstance(cfg, ModelConfig):
        return dataclasses.replace(cfg, blocks=tuple(structure(b) for b in cfg.blocks))
    if isinstance(cfg, BlockConfig):
        return dataclasses.replace(cfg, causal=False, sliding_window=None, d_k=cfg.head_dim,
                                   d_ff=cfg.d_ff if cfg.kind == "block" else 1)
    return cfg


def difference(a, b) -> str:
    """The fields in which two configs' :func:`structure` differ, ``"name: x vs y"`` joined by ``"; "``,
    a model's blocks as ``blocks[i].name`` (their number when it differs), another type by its name."""
    a, b = structure(a), structure(b)
    if type(a) is not type(b):
        return f"a {type(a).__name__} vs a {type(b).__name__}"
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "blocks" and len(x) == len(y):
            out += [f"blocks[{i}].{d}" for i, (u, v) in enumerate(zip(x, y)) if u != v for d in difference(u, v).split("; ")]
        elif f.name == "blocks" and len(x) != len(y):
            out.append(f"{len(x)} vs {len(y)} blocks")
        elif x != y:
            out.append(f"{f.name}: {x!r} vs {y!r}")
    return "; ".join(out)


def positions(module: torch.nn.Module, cfg, spec: dict, shapes: dict, what: str = "this Hessian") -> tuple:
    """Where each entry of ``module``'s stored tensors lies in a vector over our parameters: ``shapes``
    (``name -> shape``, in the vector's order; each parameter's ``vec_r`` concatenated). Returns
    ``(names, stored_shapes, perm)``: the module's parameter names (``named_parameters`` order, a tied
    tensor once) whose stored tensor ``shapes`` covers, their shapes, and ``perm`` ``(m,)`` (int64, ``m``
    their entries together, row-major in each stored tensor): the index of each in the vector, ``-1``
    for a parameter our model does not use (``Stored(())``, included when ``shapes`` covers every
    parameter of ``cfg``). The used entries of ``perm`` are a permutation of ``range(n)`` when ``shapes``
    holds only parameters of ``cfg`` (every one of ours lies in exactly one stored tensor): the map is a
    gather, no matrix. ``cfg`` and ``spec`` are the reader's description of ``module``; ``what`` names the
    vector's owner in errors.

    Raises ``ValueError`` if ``shapes`` covers a stored tensor only in part, if a shape does not match, or
    if it covers none of the module's parameters.
    """
    offsets, off = {}, 0
    for n, s in shapes.items():
        offsets[n] = off
        off += math.prod(s)
    everything = set(shapes_of(cfg)) <= set(offsets)
    names, stored, perm = [], {}, []
    for mname, p in module.named_parameters():
        s = spec.get(mname)
        if s is None:
            raise ValueError(f"{_what(module)}: cannot map parameter {mname!r}: it is not part of the architecture "
                             "from_torch reads (docs/models.md)")
        if not s.names:
            if everything:
                names.append(mname)
                stored[mname] = tuple(p.shape)
                perm.append(torch.full((p.numel(),), -1, dtype=torch.long))
            continue
        have = [n for n in s.names if n in offsets]
        if not have:
            continue
        if len(have) < len(s.names):
            raise ValueError(f"{mname} stores {', '.join(s.names)} together, but {what} has only {', '.join(have)}: "
                             f"compute it with wrt including all of {list(s.names)}")
        joined = s.joined_shape(shapes)
        if math.prod(joined) != p.numel():
            raise ValueError(f"{mname}: shape {tuple(p.shape)} does not match the Hessian's {joined}")
        idx = {n: offsets[n] + torch.arange(math.prod(shapes[n])).reshape(shapes[n]) for n in s.names}
        names.append(mname)
        stored[mname] = tuple(p.shape)
        perm.append(s.join(idx, p.shape).reshape(-1))
    if not names:
        raise ValueError(f"{what} ({list(shapes)}) covers none of the parameters of {_what(module)}")
    return names, stored, torch.cat(perm)


def relabel(H: HessianBlocks, module: torch.nn.Module, cfg, spec: dict) -> HessianBlocks:
    """``H`` re-keyed by ``module``'s parameter names (``named_parameters`` order), each block
    ``(numel_a, numel_b)`` in the stored tensors' row-major order; ``.outer`` and ``.functional``
    likewise. ``cfg`` and ``spec`` are the reader's description of ``module``.

    A stored tensor appears when ``H`` covers every parameter of ours it holds; a parameter our model
    does not use (``Stored(())``) appears, with zero blocks, when ``H`` covers every parameter of
    ``cfg``. The input block ``"X"`` is left out.

    Raises ``ValueError`` if ``H.cfg`` (when set) is another architecture than ``cfg`` (the mask
    aside), if ``H`` covers a stored tensor only in part, if a shape does not match, or if it covers
    none of the module's parameters; ``InsufficientMemoryError`` before allocating the relabelled
    ``n × n`` matrix if it would not fit.
    """
    if H.cfg is not None and structure(H.cfg) != structure(cfg):
        raise ValueError(f"H is the Hessian of another architecture than module {_what(module)} (H's vs the module's: "
                         f"{difference(H.cfg, cfg)}): its labels would not describe these numbers")
    names, shapes, perm = positions(module, cfg, spec, dict(zip(H.names, (H.shapes[n] for n in H.names))))
    m = perm.numel()
    n = sum(H.sizes)
    check_fits(m * (m + n) * H.dtype.itemsize, f"the {m}x{m} Hessian in {_what(module)}'s parameters (and its "
               f"{m}x{n} rows on the way)", H.device)
    unused = perm < 0
    perm = perm.clamp(min=0).to(H.device)
    buf = H.dense().index_select(0, perm).index_select(1, perm)
    if bool(unused.any()):
        unused = unused.to(H.device)
        buf[unused] = 0
        buf[:, unused] = 0
    parts = None
    if H.has_parts:
        def parts(which):
            return relabel(getattr(H, which), module, cfg, spec)
    return HessianBlocks.from_buffer(names, shapes, buf, parts)
