"""The user's own model, read by tracing: ``from_torch(model, example_inputs)`` (docs/models.md, "Your own model").

The forward is captured with ``torch.export.export`` on a float64 copy of the module (``torch.export``, not
``torch.fx.symbolic_trace``: it runs the Python forward on example inputs of fixed shape, so ``idx.size()``,
``assert t <= block_size`` and ``torch.arange(t)`` are specialised instead of refused), as an ATen graph whose
placeholders are the module's parameters, buffers and inputs. Each node on the way to the output is given a
meaning by its operator and the meanings of its arguments (a small symbolic interpretation: ``linear`` of a
normalised row, a column slice of a fused ``c_attn``, a head split, a causal score mask, a rotary product, ...);
the output's meaning is then parsed as the grammar of :class:`~blockhess.config.ModelConfig`
(embedding, positions, blocks, final norm, pooling, head) or of one :class:`~blockhess.config.BlockConfig`.

A node the interpretation does not know, or one in a place the grammar does not allow, is refused
(``ValueError``) with its graph name, operator, module path and source line; nothing is guessed. A submodule
a class-name reader takes (``nn.TransformerEncoder``/``Layer``, Hugging Face's GPT-2, ViT, BERT models and
blocks) is not re-read node by node: its nodes are read as one part by that reader (:mod:`.pytorch`,
:mod:`.hf`). Before returning, the config's forward is checked against the module's on the example inputs
(at the module's parameters) and on a second random input (at randomly perturbed parameters), in float64,
to ``1e-12`` relative; a larger difference is refused. Parameters that do not reach the output have
``Stored(())`` (zero Hessian blocks). The reading is remembered for the module (weakly), so that
``H.to_module(model)`` and ``A.to_module(model)`` map back without example inputs (:func:`description`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import operator
import sys
import weakref

import torch
import torch.nn as nn

from ..config import BlockConfig, ModelConfig, block_prefix, sinusoidal_positions
from ..layers.attention import rope_tables
from . import hf, pytorch
from .layout import Stored, read

__all__ = ["describe", "description", "TOLERANCE"]

#: Relative Frobenius difference allowed between the config's forward and the module's (float64).
TOLERANCE = 1e-12

_READ: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def description(module: nn.Module):
    """``(cfg, spec)`` of the last :func:`describe` of ``module`` (this very object), or ``None``."""
    return _READ.get(module)


# ---------------------------------------------------------------------------------------------- values

@dataclasses.dataclass(eq=False)
class V:
    """The meaning of one graph value: ``kind`` (what it is), ``a`` (the values it is made of), ``k`` (facts)."""

    kind: str
    node: object = None
    a: tuple = ()
    k: dict = dataclasses.field(default_factory=dict)


_HEADS = ("heads", "rope", "rep")  # (B, h, L, d_k) per-head rows
_SCORES = ("scores", "scaled", "masked")
_ROWS = ("input", "embed", "add", "norm", "linear", "act", "glu", "attn", "cls_cat", "leaf", "chunk")
#: ATen operators read as another one (same arguments, same meaning here).
_ALIASES = {"_to_copy": "to", "_softmax": "softmax", "_unsafe_view": "view", "view_copy": "view",
            "lift_fresh_copy": "contiguous", "mm": "matmul", "bmm": "matmul"}


def _site(node) -> str:
    """``name (operator) in module path, file:line: code`` of a graph node, for the messages."""
    if node is None:
        return "the module's output"
    target = getattr(node.target, "__name__", str(node.target))
    if hasattr(node.target, "name") and callable(node.target.name):
        target = node.target.name()
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    where = f" in {path!r}" if path else ""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    src = ""
    for i in range(len(trace) - 1, -1, -1):
        line = trace[i].strip()
        if line.startswith("File "):
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            src = f", {line[5:]}: {code}"
            break
    return f"node {node.name} ({target}){where}{src}"


class Refused(ValueError):
    """A node (or the module) the traced reader does not take; the message names it."""


def _refuse(node, why: str):
    raise Refused(f"from_torch (traced): {_site(node)}: {why}")


# ---------------------------------------------------------------------------------------------- interpretation

class _Interpreter:
    def __init__(self, ep, module: nn.Module):
        self.ep, self.module = ep, module
        sig = ep.graph_signature
        first = {}
        for name, p in module.named_parameters():  # a tied tensor under its first name
            first.setdefault(id(p), name)
        self.canon = {n: first[id(p)] for n, p in module.named_parameters(remove_duplicate=False)}
        self.params = {k: self.canon[v] for k, v in sig.inputs_to_parameters.items()}
        self.tensors = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers(remove_duplicate=False))
        self.consts = {k: buffers[v] for k, v in sig.inputs_to_buffers.items()}
        self.consts.update({k: ep.constants[v] for k, v in sig.inputs_to_lifted_tensor_constants.items()})
        self.user = list(sig.user_inputs)
        self.val: dict = {}
        self.leaves = self._leaves()
        self.leaf_inputs: dict = {}
        self.leaf_last: dict = {}
        self.spec: dict = {}  # the known parts' (leaf) spec entries, module names

    def _leaves(self) -> dict:
        """Outermost submodules a class-name reader takes: path -> (cfg, spec)."""
        out = {}
        for path, m in self.module.named_modules():
            if any(not p or path == p or path.startswith(p + ".") for p in out):
                continue
            if hf.reads(m):
                out[path] = hf.describe(m)
            elif pytorch.reads(m):
                out[path] = pytorch.describe(m, False)
        return out

    def _leaf_of(self, node):
        for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
            if path in self.leaves:
                return path
        return None

    def run(self) -> V:
        graph = self.ep.graph
        out_node = next(n for n in graph.nodes if n.op == "output")
        outs = out_node.args[0]
        if len(outs) != 1 or not isinstance(outs[0], torch.fx.Node):
            raise Refused(f"from_torch (traced): the forward returns {len(outs)} values; one tensor is read "
                          "(return the logits, or wrap the module)")
        needed, todo = set(), [outs[0]]
        while todo:
            n = todo.pop()
            if n in needed:
                continue
            needed.add(n)
            todo.extend(n.all_input_nodes)
        for node in graph.nodes:
            if node not in needed:
                continue
            if node.op == "placeholder":
                self.val[node] = self._placeholder(node)
                continue
            path = self._leaf_of(node)
            if path is not None:
                self.val[node] = self._in_leaf(node, path)
                continue
            self.val[node] = self._op(node)
        self.used = {self.params[n.name] for n in needed if n.op == "placeholder" and n.name in self.params}
        return self.val[outs[0]]

    def _placeholder(self, node) -> V:
        if node.name in self.params:
            fqn = self.params[node.name]
            return V("param", node, k={"name": fqn, "t": self.tensors[fqn]})
        if node.name in self.consts:
            return V("const", node, k={"t": self.consts[node.name]})
        if node.name in self.user:
            return V("input", node, k={"t": node.meta["val"], "i": self.user.index(node.name)})
        _refuse(node, "an input the reader does not know")

    def _in_leaf(self, node, path) -> V:
        for a in node.all_input_nodes:
            v = self.val[a]
            if v.kind not in ("param", "const") and self._leaf_of(a) != path:
                self.leaf_inputs.setdefault(path, [])
                if all(v is not w for w in self.leaf_inputs[path]):
                    self.leaf_inputs[path].append(v)
        self.leaf_last[path] = node
        cfg, spec = self.leaves[path]
        return V("leaf", node, k={"path": path, "cfg": cfg, "spec": spec})

    # ------------------------------------------------------------------------------------------ one node

    def _subst(self, x):
        if isinstance(x, torch.fx.Node):
            return self.val[x]
        if isinstance(x, (list, tuple)):
            return type(x)(self._subst(y) for y in x)
        return x

    def _op(self, node) -> V:
        if node.op != "call_function":
            _refuse(node, f"a {node.op} node is not read")
        args, kw = self._subst(node.args), self._subst(dict(node.kwargs))
        flat = [v for v in torch.utils._pytree.tree_leaves((args, kw)) if isinstance(v, V)]
        target = node.target
        if target is operator.getitem:
            return self._getitem(node, args)
        if not isinstance(target, torch._ops.OpOverload):
            _refuse(node, "a call the reader does not know (a custom operator or a higher-order operation)")
        name = target._overloadpacket.__name__
        name = _ALIASES.get(name, name)
        if torch.Tag.nondeterministic_seeded in target.tags and name not in ("dropout", "scaled_dot_product_attention"):
            _refuse(node, "a random operation: the closed form is the Hessian of a deterministic forward")
        if all(v.kind == "const" for v in flat):  # a fixed tensor: arange, a mask, rotary tables
            real = torch.utils._pytree.tree_map(lambda v: v.k["t"] if isinstance(v, V) else v, (args, kw))
            return V("const", node, k={"t": target(*real[0], **real[1])})
        handler = getattr(self, f"_{name}", None)
        if handler is None:
            _refuse(node, f"the operator {name} is not part of the closed form's Transformer (docs/models.md)")
        out = handler(node, *args, **kw)
        if out is None:
            _refuse(node, f"{name} of {', '.join(v.kind for v in flat)}: not a use the closed form covers")
        return out

    @staticmethod
    def _shape(node) -> tuple:
        return tuple(node.meta["val"].shape)

    def _dim(self, node, d: int) -> int:
        return d % len(self._shape(node))

    # identities
    def _dropout(self, node, x, p=0.0, train=False):
        if train and p != 0:
            _refuse(node, f"dropout p={p} in training mode: the forward is random (call module.eval())")
        return x

    def _contiguous(self, node, x, **kw):
        return x

    _clone = _contiguous
    _alias = _contiguous

    def _to(self, node, x, *args, **kw):
        if node.meta["val"].dtype != x.node.meta["val"].dtype:
            _refuse(node, f"a cast to {node.meta['val'].dtype}: the closed form computes in the input's dtype "
                          "(remove the cast: the float64 reference would not be exact)")
        return x

    _type_as = _to

    # embeddings and positions
    def _embedding(self, node, W, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
        if W.kind != "param" or padding_idx != -1 or scale_grad_by_freq:
            if W.kind == "param":
                _refuse(node, "an Embedding with padding_idx or scale_grad_by_freq: their gradients are not the "
                              "derivative of the forward")
            return None
        if idx.kind == "input":
            return V("embed", node, k={"how": "token", "W": W})
        if idx.kind == "const":
            t = idx.k["t"].reshape(-1)
            if not torch.equal(t.cpu(), torch.arange(t.numel())):
                _refuse(node, "positions other than 0, 1, ..., L-1")
            return V("pos", node, k={"W": W})
        return None

    def _conv2d(self, node, x, W, b=None, stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1):
        if x.kind != "input" or W.kind != "param" or (b is not None and b.kind != "param"):
            return None
        p = W.k["t"].shape[-1]
        if W.k["t"].shape[-2] != p or list(stride) != [p, p] or list(padding) != [0, 0] or list(dilation) != [1, 1] \
                or groups != 1:
            _refuse(node, f"a Conv2d other than square non-overlapping patches (kernel = stride, no padding), got "
                          f"kernel {tuple(W.k['t'].shape[-2:])}, stride {stride}, padding {padding}")
        return V("patchmap", node, k={"W": W, "b": b, "p": p, "image": tuple(x.k["t"].shape[1:])})

    def _flatten(self, node, x, start=0, end=-1):
        if x.kind == "patchmap" and start == 2 and end in (-1, 3):
            return V("patchflat", node, k=x.k)
        return None

    def _expand(self, node, x, size, **kw):
        if x.kind == "param" and x.k["t"].dim() == 3 and x.k["t"].shape[:2] == (1, 1):
            return V("cls", node, k={"W": x})
        if x.kind == "unsq":
            return V("expanded", node, (x.a[0],), {"rep": self._shape(node)[2]})
        return None

    def _cat(self, node, xs, dim=0):
        dim = self._dim(node, dim)
        if len(xs) == 2 and xs[0].kind == "cls" and xs[1].kind in _ROWS and dim == 1:
            return V("cls_cat", node, (xs[1],), {"cls": xs[0].k["W"]})
        if len(xs) == 2 and xs[0].kind == "neghalf" and xs[1].kind == "half" and xs[0].a[0] is xs[1].a[0] \
                and xs[1].k["i"] == 0 and dim == len(self._shape(node)) - 1:
            return V("rot", node, (xs[1].a[0],))
        return None

    # linear maps
    def _linear(self, node, x, W, b=None):
        if x.kind not in _ROWS + ("pool",) or W.kind != "param" or (b is not None and b.kind != "param"):
            return None
        return V("linear", node, (x,), {"W": W, "b": b, "transposed": True})

    def _matmul(self, node, a, b):
        if a.kind in _ROWS and b.kind == "param" and b.k["t"].dim() == 2:
            return V("linear", node, (a,), {"W": b, "b": None, "transposed": False})
        if a.kind in _HEADS and b.kind == "kT":
            return V("scores", node, (a, b.a[0]))
        if a.kind == "probs" and b.kind in _HEADS:
            s = a.a[0]
            causal, scale = False, 1.0
            if s.kind == "masked":
                causal, s = True, s.a[0]
            if s.kind == "scaled":
                scale, s = s.k["s"], s.a[0]
            if s.kind != "scores":
                _refuse(a.node, "softmax of something other than the (scaled, masked) scores q kᵀ")
            return V("headsout", node, (s.a[0], s.a[1], b), {"causal": causal, "scale": scale})
        return None

    def _scaled_dot_product_attention(self, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                      enable_gqa=False):
        if not all(t.kind in _HEADS for t in (q, k, v)):
            return None
        if dropout_p != 0:
            _refuse(node, f"attention dropout_p={dropout_p}: the forward is random")
        causal = bool(is_causal)
        if attn_mask is not None:
            if attn_mask.kind != "const" or not _is_causal(attn_mask.k["t"], self._shape(q.node)[-2], keep=True):
                _refuse(node, "an attention mask other than the causal one (an additive bias such as ALiBi, a padding "
                              "mask) is not in the closed form")
            causal = True
        if enable_gqa:
            hq, hk = self._shape(q.node)[1], self._shape(k.node)[1]
            k = V("rep", k.node, (k,), {"rep": hq // hk})
            v = V("rep", v.node, (v,), {"rep": hq // hk})
        d_k = self._shape(q.node)[-1]
        return V("headsout", node, (q, k, v), {"causal": causal, "scale": d_k ** -0.5 if scale is None else scale})

    def _softmax(self, node, x, dim, half_to_float=False, **kw):
        if x.kind in _SCORES and self._dim(node, dim) == len(self._shape(node)) - 1 and not half_to_float:
            if kw.get("dtype") not in (None, node.meta["val"].dtype):
                return None
            return V("probs", node, (x,))
        return None


    def _masked_fill(self, node, s, mask, value):
        if s.kind in ("scores", "scaled") and mask.kind == "const" and value == float("-inf"):
            if not _is_causal(mask.k["t"], self._shape(node)[-1], keep=False):
                _refuse(node, "a score mask other than the causal one (True above the diagonal)")
            return V("masked", node, (s,))
        return None

    # arithmetic
    def _add(self, node, a, b, alpha=1):
        if alpha != 1:
            return None
        if not isinstance(b, V):
            if a.kind == "var":
                return V("var_eps", node, (a.a[0],), {"eps": float(b), "centered": a.k["centered"]})
            return None
        for x, y in ((a, b), (b, a)):
            if x.kind == "linear" and x.k["b"] is None and y.kind == "param" and y.k["t"].dim() == 1:
                return V("linear", node, x.a, {**x.k, "b": y})
            if x.kind == "norm" and x.k["beta"] is None and x.k["type"] == "layer" and y.kind == "param" \
                    and y.k["t"].dim() == 1:
                return V("norm", node, x.a, {**x.k, "beta": y})
            if x.kind in ("scores", "scaled") and y.kind == "const":
                if not _is_causal(y.k["t"], self._shape(node)[-1], keep=False, additive=True):
                    _refuse(node, "an additive bias on the attention scores other than the causal mask (ALiBi, "
                                  "relative positions) is not in the closed form")
                return V("masked", node, (x,))
            if x.kind == "cosmul" and y.kind == "sinmul" and x.a[0] is y.a[0]:
                return V("rope", node, (x.a[0],), {"cos": x.k["t"], "sin": y.k["t"]})
            if x.kind in _ROWS and y.kind == "param" and y.k["t"].dim() in (2, 3):
                return V("add", node, (x, V("pos", y.node, k={"W": y})))
            if x.kind == "embed" and y.kind == "const" and self._sinusoidal(node, y.k["t"]):
                return V("add", node, (x, V("sinus", y.node)))
            if x.kind in _ROWS and y.kind in _ROWS + ("pos",):
                return V("add", node, (x, y))
        return None

    def _sinusoidal(self, node, t: torch.Tensor) -> bool:
        """Whether the constant ``t`` added to the embedded tokens is ``sinusoidal_positions(L, d)`` (to
        1e-12 relative, a table built in float64); a table equal only to float32's rounding is refused."""
        shape = self._shape(node)
        if t.dim() < 2 or tuple(t.shape[-2:]) != tuple(shape[-2:]) or any(s != 1 for s in t.shape[:-2]):
            return False
        L, d = shape[-2:]
        if d % 2:
            return False
        P = sinusoidal_positions(L, d)
        err = float((t.reshape(L, d).double().cpu() - P).abs().max())
        if err <= 1e-12:
            return True
        if err <= 1e-5:
            _refuse(node, f"a sinusoidal position table off by {err:.2g} from the float64 one (a table computed in "
                          "float32): build it in float64")
        return False

    def _sub(self, node, a, b, alpha=1):
        if alpha == 1 and isinstance(b, V) and b.kind == "mean" and b.a[0] is a:
            return V("centered", node, (a,))
        return None

    def _mean(self, node, x, dim=None, keepdim=False, **kw):
        dims = [self._dim(x.node, d) for d in (dim or [])]
        last = len(self._shape(x.node)) - 1
        if dims == [last] and keepdim:
            if x.kind in _ROWS:
                return V("mean", node, (x,))
            if x.kind == "sq":
                return V("var", node, x.a, {"centered": x.a[0].kind == "centered"})
        if dims == [1] and not keepdim and x.kind in _ROWS and last == 2:
            return V("pool", node, (x,), {"how": "mean"})
        return None

    def _var(self, node, x, dim=None, correction=None, keepdim=False):
        dims = [self._dim(x.node, d) for d in (dim or [])]
        if x.kind in _ROWS and dims == [len(self._shape(x.node)) - 1] and keepdim and correction == 0:
            return V("var", node, (V("centered", node, (x,)),), {"centered": True})
        return None

    def _pow(self, node, x, e):
        if e == 2 and isinstance(x, V) and (x.kind in _ROWS or x.kind == "centered"):
            return V("sq", node, (x,))
        return None

    def _square(self, node, x):
        return self._pow(node, x, 2)

    def _rsqrt(self, node, x):
        if x.kind == "var_eps":
            return V("inv", node, x.a, x.k)
        return None

    def _sqrt(self, node, x):
        if x.kind == "var_eps":
            return V("std", node, x.a, x.k)
        return None

    def _bare_norm(self, node, x, r):
        """``x * rsqrt(var + eps)`` (or ``x / sqrt(...)``): a LayerNorm (``x`` centred) or an RMSNorm."""
        base = x.a[0] if x.kind == "centered" else x
        centered_var = r.k["centered"]
        var_of = r.a[0].a[0] if r.a[0].kind == "centered" else r.a[0]
        if var_of is not base or (x.kind == "centered") != centered_var:
            return None
        return V("norm", node, (base,), {"type": "layer" if centered_var else "rms", "eps": r.k["eps"],
                                         "gamma": None, "beta": None})

    def _mul(self, node, a, b):
        if not isinstance(b, V):
            if a.kind == "scores":
                return V("scaled", node, (a,), {"s": float(b)})
            return None
        for x, y in ((a, b), (b, a)):
            if y.kind == "inv" and (x.kind in _ROWS or x.kind == "centered"):
                out = self._bare_norm(node, x, y)
                if out is not None:
                    return out
            if x.kind == "norm" and x.k["gamma"] is None and x.k["beta"] is None and y.kind == "param" \
                    and y.k["t"].dim() == 1:
                return V("norm", node, x.a, {**x.k, "gamma": y})
            if x.kind in _HEADS and y.kind == "const":
                return V("cosmul", node, (x,), {"t": y.k["t"]})
            if x.kind == "rot" and y.kind == "const":
                return V("sinmul", node, (x.a[0],), {"t": y.k["t"]})
            if x.kind == "sigmoid" and x.a[0] is y:
                return V("act", node, (y,), {"name": "silu"})
            if x.kind == "act" and y.kind == "linear":
                return V("glu", node, (x, y))
        if a is b and (a.kind in _ROWS or a.kind == "centered"):
            return V("sq", node, (a,))
        for x, y in ((a, b), (b, a)):
            if y.kind == "param":
                _refuse(node, f"a product with the parameter {y.k['name']!r} outside a norm (a learned scale on a "
                              "branch such as LayerScale) is not in the closed form")
        return None

    def _div(self, node, a, b):
        if not isinstance(b, V):
            if a.kind == "scores":
                return V("scaled", node, (a,), {"s": 1.0 / float(b)})
            return None
        if b.kind == "std" and (a.kind in _ROWS or a.kind == "centered"):
            return self._bare_norm(node, a, b)
        return None

    def _neg(self, node, x):
        if x.kind == "half" and x.k["i"] == 1:
            return V("neghalf", node, x.a)
        return None

    # norms and activations
    def _layer_norm(self, node, x, shape, w=None, b=None, eps=1e-5, cudnn=False):
        if x.kind not in _ROWS or len(shape) != 1 or any(p is not None and p.kind != "param" for p in (w, b)):
            return None
        return V("norm", node, (x,), {"type": "layer", "eps": float(eps), "gamma": w, "beta": b})

    def _rms_norm(self, node, x, shape, w=None, eps=None):
        if x.kind not in _ROWS or len(shape) != 1 or (w is not None and w.kind != "param"):
            return None
        eps = torch.finfo(node.meta["val"].dtype).eps if eps is None else eps
        return V("norm", node, (x,), {"type": "rms", "eps": float(eps), "gamma": w, "beta": None})

    def _act(self, node, x, name):
        return V("act", node, (x,), {"name": name}) if x.kind == "linear" else None

    def _relu(self, node, x):
        return self._act(node, x, "relu")

    def _silu(self, node, x):
        return self._act(node, x, "silu")

    def _gelu(self, node, x, approximate="none"):
        return self._act(node, x, "gelu_tanh" if approximate == "tanh" else "gelu")

    def _sigmoid(self, node, x):
        return V("sigmoid", node, (x,)) if x.kind == "linear" else None

    # layouts: the head split and merge, the fused projections
    def _view(self, node, x, shape):
        out, src = self._shape(node), self._shape(x.node)
        if out == src:
            return x
        if x.kind in ("linear", "chunk") and len(out) == 4 and out[:2] == src[:2]:  # (B, T, C) -> (B, T, h, d)
            return V("split4", node, (x,), {"h": out[2], "d": out[3]})
        if x.kind == "linear" and len(out) == 5 and out[:2] == src[:2]:  # (B, T, 3C) -> (B, T, 3, h, d)
            return V("split5", node, (x,), {"n": out[2], "h": out[3], "d": out[4]})
        if x.kind == "merged4" and len(out) == 3 and out[:2] == src[:2]:  # (B, T, h, d) -> (B, T, h d)
            return V("attn", node, x.a)
        if x.kind == "patchmap" and len(out) == 3:
            return V("patchflat", node, k=x.k)
        if x.kind == "expanded" and len(out) == 4:
            return V("rep", node, x.a, x.k)
        return None

    _reshape = _view

    def _transpose(self, node, x, d0, d1):
        n = len(self._shape(x.node))
        pair = tuple(sorted((d0 % n, d1 % n)))
        if x.kind == "split4" and pair == (1, 2):
            return V("heads", node, x.a, x.k)
        if x.kind in _HEADS and pair == (2, 3):
            return V("kT", node, (x,))
        if x.kind == "headsout" and pair == (1, 2):
            return V("merged4", node, (x,))
        if x.kind == "patchflat" and pair == (1, 2):
            return V("embed", node, k={"how": "patch", **x.k})
        return None

    def _permute(self, node, x, dims):
        dims = [d % len(dims) for d in dims]
        if dims == [0, 2, 1, 3]:
            return self._transpose(node, x, 1, 2)
        if dims == [0, 1, 3, 2]:
            return self._transpose(node, x, 2, 3)
        if x.kind == "split5" and dims == [2, 0, 3, 1, 4]:
            return V("stack5", node, x.a, x.k)
        return None

    def _split(self, node, x, size, dim=0):
        if x.kind == "linear" and self._dim(x.node, dim) == len(self._shape(x.node)) - 1:
            total = self._shape(x.node)[-1]
            sizes = [size] * (total // size) + ([total % size] if total % size else []) if isinstance(size, int) \
                else list(size)
            return V("splits", node, (x,), {"sizes": sizes})
        return None

    _split_with_sizes = _split

    def _chunk(self, node, x, n, dim=0):
        total = self._shape(x.node)[self._dim(x.node, dim)]
        return self._split(node, x, -(-total // n), dim)

    def _unbind(self, node, x, dim=0):
        if x.kind == "stack5" and dim == 0:
            return V("unbound", node, x.a, x.k)
        return None

    def _select(self, node, x, dim, i):
        if x.kind == "stack5" and dim == 0:
            return self._stack_part(node, x, i)
        if x.kind in _ROWS and len(self._shape(x.node)) == 3 and self._dim(x.node, dim) == 1 and i == 0:
            return V("pool", node, (x,), {"how": "first"})
        return None

    def _stack_part(self, node, x, i):
        w = x.k["h"] * x.k["d"]
        chunk = V("chunk", node, x.a, {"start": i * w, "width": w})
        return V("heads", node, (chunk,), {"h": x.k["h"], "d": x.k["d"]})

    def _getitem(self, node, args):
        x, i = args
        if x.kind == "splits":
            return V("chunk", node, x.a, {"start": sum(x.k["sizes"][:i]), "width": x.k["sizes"][i]})
        if x.kind == "unbound":
            return self._stack_part(node, x, i)
        _refuse(node, f"an item of {x.kind}")

    def _slice(self, node, x, dim=0, start=None, end=None, step=1):
        size = self._shape(x.node)[self._dim(x.node, dim)]
        if step == 1 and start in (None, 0) and (end is None or end >= size):
            return x
        if x.kind not in _HEADS or step != 1:
            return None
        d = self._shape(x.node)[-1]
        if self._dim(x.node, dim) != len(self._shape(x.node)) - 1 or d % 2:
            return None
        start = 0 if start is None else start
        end = d if end is None else min(end, d)
        if (start, end) == (0, d // 2):
            return V("half", node, (x,), {"i": 0})
        if (start, end) == (d // 2, d):
            return V("half", node, (x,), {"i": 1})
        return None

    def _unsqueeze(self, node, x, dim):
        if x.kind in _HEADS and self._dim(node, dim) == 2:
            return V("unsq", node, (x,))
        return None

    def _repeat_interleave(self, node, x, repeats, dim=None, **kw):
        if x.kind in _HEADS and isinstance(repeats, int) and dim is not None and self._dim(x.node, dim) == 1:
            return V("rep", node, (x,), {"rep": repeats})
        return None


def _is_causal(t: torch.Tensor, L: int, keep: bool, additive: bool = False) -> bool:
    """Whether ``t`` (broadcast to ``(..., L, L)``) is the causal mask: boolean ``True`` where masked (``keep``:
    where attended), or additive ``-inf`` above the diagonal and ``0`` elsewhere."""
    t = t.detach().cpu()
    if t.shape[-2:] != (L, L):
        return False
    t = t.reshape(-1, L, L)
    upper = torch.ones(L, L, dtype=torch.bool).triu(1)
    if t.dtype == torch.bool and not additive:
        want = ~upper if keep else upper
        return bool((t == want).all())
    if t.is_floating_point():
        return bool(torch.isneginf(t[:, upper]).all() and (t[:, ~upper] == 0).all())
    return False


# ---------------------------------------------------------------------------------------------- the grammar

class _Parse:
    """Parse the output's meaning as embedding -> blocks -> final norm -> pool -> head; collect the spec."""

    def __init__(self, interp: _Interpreter):
        self.it = interp
        self.uses: dict = {}  # module parameter -> [(our name, role, facts)]

    def use(self, param: V, ours: str, **facts) -> None:
        self.uses.setdefault(param.k["name"], []).append((ours, facts))

    def fail(self, v: V, why: str):
        _refuse(v.node, why)

    # blocks
    def block(self, v: V, i: int):
        """``(x, fields)`` if ``v`` is the output of a block whose input is ``x``; else ``None``."""
        pfx = block_prefix(i)
        if v.kind == "leaf" and isinstance(v.k["cfg"], BlockConfig) and v.k["cfg"].kind == "block":
            return self.leaf_input(v), {"leaf": v}
        if v.kind == "add":  # pre-LN: y + FFN(N_2(y)), y = x + SA(N_1(x))
            for y, f in (v.a, v.a[::-1]):
                ffn = self.ffn(f)
                if ffn is None or ffn[0].kind != "norm" or ffn[0].a[0] is not y or y.kind != "add":
                    continue
                for x, s in (y.a, y.a[::-1]):
                    sa = self.sa(s)
                    if sa is not None and sa[0].kind == "norm" and sa[0].a[0] is x:
                        return x, dict(norm="pre", n1=sa[0], n2=ffn[0], sa=sa[1], ffn=ffn[1], pfx=pfx)
        if v.kind == "norm" and v.a[0].kind == "add":  # post-LN: N_2(y + FFN(y)), y = N_1(x + SA(x))
            for y, f in (v.a[0].a, v.a[0].a[::-1]):
                ffn = self.ffn(f)
                if ffn is None or ffn[0] is not y or y.kind != "norm" or y.a[0].kind != "add":
                    continue
                for x, s in (y.a[0].a, y.a[0].a[::-1]):
                    sa = self.sa(s)
                    if sa is not None and sa[0] is x:
                        return x, dict(norm="post", n1=y, n2=v, sa=sa[1], ffn=ffn[1], pfx=pfx)
        return None

    def ffn(self, f: V):
        if f.kind != "linear":
            return None
        h = f.a[0]
        if h.kind == "act" and h.a[0].kind == "linear":
            return h.a[0].a[0], dict(W_2=f, act=h.k["name"], W_1=h.a[0], W_G=None)
        if h.kind == "glu" and h.a[0].a[0].kind == "linear" and h.a[1].kind == "linear" \
                and h.a[0].a[0].a[0] is h.a[1].a[0]:
            return h.a[1].a[0], dict(W_2=f, act=h.a[0].k["name"], W_1=h.a[1], W_G=h.a[0].a[0])
        return None

    def sa(self, s: V):
        if s.kind == "leaf" and isinstance(s.k["cfg"], BlockConfig) and s.k["cfg"].kind == "attention":
            mha = self.it.module.get_submodule(s.k["path"])  # an nn.MultiheadAttention(x, x, x)[0]
            if isinstance(mha, nn.MultiheadAttention) and not mha.batch_first:
                self.fail(s, f"{s.k['path']!r} is an nn.MultiheadAttention with batch_first=False inside a block: its "
                             "input would be (L, B, d); use batch_first=True")
            return self.leaf_input(s), dict(leaf=s)
        out = None
        if s.kind == "linear" and s.a[0].kind == "attn":
            out, s = s, s.a[0]
        if s.kind != "attn":
            return None
        ho = s.a[0]
        parts = {}
        for role, h in zip("QKV", ho.a):
            facts = {"rope": None, "rep": 1}
            while h.kind in ("rope", "rep"):
                facts[h.kind] = h if h.kind == "rope" else h.k["rep"]
                h = h.a[0]
            if h.kind != "heads":
                return None
            src = h.a[0]
            chunk = None
            if src.kind == "chunk":
                chunk, src = src, src.a[0]
            if src.kind != "linear":
                return None
            parts[role] = dict(lin=src, chunk=chunk, h=h.k["h"], d=h.k["d"], **facts)
        x = parts["Q"]["lin"].a[0]
        if any(p["lin"].a[0] is not x for p in parts.values()):
            return None
        return x, dict(parts=parts, out=out, causal=ho.k["causal"], scale=ho.k["scale"], node=ho.node)

    def leaf_input(self, v: V) -> V:
        ins = self.it.leaf_inputs.get(v.k["path"], [])
        if len(ins) != 1:
            self.fail(v, f"the part {v.k['path']!r} takes {len(ins)} inputs; one is read")
        if v.node is not self.it.leaf_last[v.k["path"]]:
            self.fail(v, f"a value computed inside {v.k['path']!r} other than its output")
        return ins[0]

    # the whole model
    def model(self, out: V):
        kw, v = {}, out
        if v.kind == "linear" and self.block(v, 0) is None and self.sa(v) is None:
            kw.update(head=v.k["W"].k["t"].shape[0 if v.k["transposed"] else 1], head_bias=v.k["b"] is not None)
            head, v = v, v.a[0]
        else:
            head = None
        if v.kind == "pool":
            kw["pool"] = v.k["how"]
            v = v.a[0]
        final = None
        if v.kind == "norm" and self.block(v, 0) is None:
            final, v = v, v.a[0]
        blocks = []
        while True:
            got = self.block(v, 0)
            if got is None:
                break
            v, fields = got
            blocks.append(fields)
        blocks.reverse()
        if v.kind == "leaf" and isinstance(v.k["cfg"], ModelConfig):
            return self.leaf_model(v, blocks, final, head, kw)
        if not blocks:
            if v.kind == "attn" or (v.kind == "linear" and v.a[0].kind == "attn"):
                return self.attention_only(v, out, head, final, kw)
            self.fail(v, "expected the output of a Transformer block (x + FFN(N(x)) after "
                                      "x + SA(N(x)), or N(x + FFN(x)) after N(x + SA(x))) here")
        return self.assemble(v, blocks, final, head, kw)

    def attention_only(self, v, out, head, final, kw):
        sa = self.sa(v)
        if sa is None or sa[0].kind != "input" or head is not None or final is not None or kw:
            self.fail(v, "a bare attention layer is read only alone (its input the module's input)")
        cfg = self.block_cfg(dict(sa=sa[1], ffn=None, pfx="", norm="post", n1=None, n2=None), kind="attention",
                             d=sa[0].k["t"].shape[-1])
        return cfg

    def leaf_model(self, v, blocks, final, head, kw):
        cfg = v.k["cfg"]
        if blocks or final is not None or ((cfg.head is not None or cfg.pool != "none") and (head is not None or kw)):
            self.fail(v, f"{v.k['path']!r} is a whole model; only a pooling and a linear head may follow it (where "
                         "it has none)")
        if self.leaf_input(v).kind != "input":
            self.fail(v, f"{v.k['path']!r} must take the module's input itself")
        self.leaf_spec(v, "")
        if head is not None:
            self.head(head)
        return dataclasses.replace(cfg, **kw)

    def leaf_spec(self, v, oprefix: str) -> None:
        for mname, s in v.k["spec"].items():
            self.it.spec[f"{v.k['path']}.{mname}" if v.k["path"] else mname] = Stored(tuple(oprefix + n for n in s.names), s.axis, s.transposed)

    def head(self, head: V) -> bool:
        """Record the head's parameters; whether its weight is the token embedding's (``tied``)."""
        W = head.k["W"]
        tied = head.k["transposed"] and [u[0] for u in self.uses.get(W.k["name"], [])] == ["W_E"]
        if not tied:
            self.use(W, "W_H", transposed=head.k["transposed"])
        if head.k["b"] is not None:
            self.use(head.k["b"], "b_H")
        return tied

    def assemble(self, x0: V, blocks: list, final, head, kw):
        emb = self.embedding(x0, kw)
        single = emb == "none" and len(blocks) == 1 and head is None and final is None and set(kw) == {"embedding"}
        cfgs = []
        for i, fields in enumerate(blocks):
            pfx = "" if single else block_prefix(i)
            if "leaf" in fields:
                leaf = fields["leaf"]
                self.leaf_spec(leaf, pfx)
                cfgs.append(leaf.k["cfg"])
                continue
            fields["pfx"] = pfx
            cfgs.append(self.block_cfg(fields, d=None))
        if final is not None:
            self.model_norm(final, "F", kw)
        if head is not None:
            kw["tied"] = self.head(head)
        if single:
            return cfgs[0]
        return ModelConfig(blocks=tuple(cfgs), **kw)

    def model_norm(self, n: V, suffix: str, kw: dict) -> None:
        facts = dict(norm_type=n.k["type"], norm_affine=n.k["gamma"] is not None, norm_bias=n.k["beta"] is not None,
                     norm_eps=n.k["eps"])
        for key, value in facts.items():
            if key in kw and kw[key] != value:
                self.fail(n, f"the embedding and final norms differ ({key}); ModelConfig has one setting")
        kw.update(facts)
        kw["embed_norm" if suffix == "E" else "final_norm"] = True
        if n.k["gamma"] is not None:
            self.use(n.k["gamma"], f"gamma_{suffix}")
        if n.k["beta"] is not None:
            self.use(n.k["beta"], f"beta_{suffix}")

    def embedding(self, v: V, kw: dict) -> str:
        if v.kind == "norm":
            self.model_norm(v, "E", kw)
            v = v.a[0]
        pos = None
        if v.kind == "add":
            a, b = v.a
            pos, v = (a, b) if a.kind in ("pos", "sinus") else (b, a) if b.kind in ("pos", "sinus") else (None, v)
            if pos is None:
                self.fail(v, "an embedding sum other than tokens + learned or sinusoidal positions")
        cls = None
        if v.kind == "cls_cat":
            cls, v = v, v.a[0]
        if v.kind == "linear" and v.a[0].kind == "input":
            v = V("embed", v.node, k={"how": "linear", "W": v.k["W"], "b": v.k["b"], "transposed": v.k["transposed"]})
        if v.kind == "input":
            if pos is not None or cls is not None:
                self.fail(v, "positions or a CLS token without an embedding")
            kw["embedding"] = "none"
            return "none"
        if v.kind != "embed":
            self.fail(v, "expected the embedding of the input (nn.Embedding of token ids, a patch Conv2d, "
                         "an nn.Linear of features) here")
        how = v.k["how"]
        kw["embedding"] = how
        W = v.k["W"]
        if how == "token":
            kw["vocab"] = W.k["t"].shape[0]
            self.use(W, "W_E")
        elif how == "patch":
            kw.update(image=v.k["image"], patch=v.k["p"], embed_bias=v.k["b"] is not None)
            self.use(W, "W_E", transposed=True)
            if v.k["b"] is not None:
                self.use(v.k["b"], "b_E")
        else:
            t = W.k["t"]
            kw.update(d_in=t.shape[1] if v.k["transposed"] else t.shape[0], embed_bias=v.k["b"] is not None)
            self.use(W, "W_E", transposed=v.k["transposed"])
            if v.k["b"] is not None:
                self.use(v.k["b"], "b_E")
        if cls is not None:
            kw["cls_token"] = True
            self.use(cls.k["cls"], "cls")
        if pos is not None and pos.kind == "sinus":
            kw["positions"] = "sinusoidal"
        elif pos is not None:
            P = pos.k["W"]
            t = P.k["t"]
            kw.update(positions="learned", n_positions=t.shape[-2])
            self.use(P, "W_P")
        return how

    def block_cfg(self, f: dict, d=None, kind="block") -> BlockConfig:
        pfx, sa = f["pfx"], f["sa"]
        if "leaf" in sa:  # a known attention module: its reader's options and spec
            a = sa["leaf"].k["cfg"]
            self.leaf_spec(sa["leaf"], pfx)
            opts = dict(d_model=a.d_model, d_k=a.d_k, n_heads=a.n_heads, out_proj=a.out_proj, causal=a.causal,
                        kind=kind)
            biases = {r: a.bias for r in "QKVO"}
            return self.finish_block(f, pfx, opts, biases, sa["leaf"].node)
        parts = sa["parts"]
        q, k, v = parts["Q"], parts["K"], parts["V"]
        d_k, h = q["d"], q["h"]
        if abs(sa["scale"] - d_k ** -0.5) > 1e-12 * d_k ** -0.5:
            _refuse(sa["node"], f"attention scale {sa['scale']}: only 1/sqrt(d_k) = {d_k ** -0.5} is in the closed form")
        if k["d"] != d_k or k["h"] * k["rep"] != h or v["h"] != k["h"] or v["rep"] != k["rep"] or q["rep"] != 1:
            _refuse(sa["node"], "query, key and value heads that do not pair as (grouped-query) attention")
        if (q["rope"] is None) != (k["rope"] is None) or v["rope"] is not None:
            _refuse(sa["node"], "rotary embeddings on some of the queries and keys only")
        theta = None
        if q["rope"] is not None:
            theta = self.rope_theta(q["rope"], d_k)
            if self.rope_theta(k["rope"], d_k) != theta:
                _refuse(k["rope"].node, "the keys' rotary tables differ from the queries'")
        biases = {}
        lins = {role: p["lin"] for role, p in parts.items()}
        fused = lins["Q"] is lins["K"] or lins["K"] is lins["V"] or lins["Q"] is lins["V"]
        if fused:
            if not (lins["Q"] is lins["K"] is lins["V"]) or any(p["chunk"] is None for p in parts.values()):
                _refuse(sa["node"], "a projection fused for only some of Q, K, V")
            lin = lins["Q"]
            order = sorted("QKV", key=lambda r: parts[r]["chunk"].k["start"])
            self.use(lin.k["W"], tuple(pfx + "W_" + r for r in order), transposed=lin.k["transposed"], fused=True)
            if lin.k["b"] is not None:
                self.use(lin.k["b"], tuple(pfx + "b_" + r for r in order), fused=True)
            biases.update({r: lin.k["b"] is not None for r in "QKV"})
        else:
            for r in "QKV":
                if parts[r]["chunk"] is not None:
                    _refuse(parts[r]["chunk"].node, "a slice of a projection that is not Q, K, V fused")
                self.use(lins[r].k["W"], pfx + "W_" + r, transposed=lins[r].k["transposed"])
                if lins[r].k["b"] is not None:
                    self.use(lins[r].k["b"], pfx + "b_" + r)
                biases[r] = lins[r].k["b"] is not None
        out = sa["out"]
        if out is not None:
            self.use(out.k["W"], pfx + "W_O", transposed=out.k["transposed"])
            if out.k["b"] is not None:
                self.use(out.k["b"], pfx + "b_O")
            biases["O"] = out.k["b"] is not None
        d_model = d if d is not None else lins["Q"].a[0].node.meta["val"].shape[-1]
        opts = dict(d_model=int(d_model), d_k=d_k, n_heads=h, n_kv_heads=k["h"] if k["h"] != h else None,
                    d_v=v["d"] if v["d"] * h != d_model else None, out_proj=out is not None, causal=sa["causal"],
                    kind=kind, rope=theta is not None, rope_theta=theta if theta is not None else 10000.0)
        return self.finish_block(f, pfx, opts, biases, sa["node"])

    def finish_block(self, f: dict, pfx: str, opts: dict, biases: dict, at) -> BlockConfig:
        """The FFN's and norms' options and parameters added to the attention's ``opts``; the biases checked."""
        kind = opts["kind"]
        norms = [n for n in (f["n1"], f["n2"]) if n is not None]
        if kind == "block":
            ffn = f["ffn"]
            self.use(ffn["W_1"].k["W"], pfx + "W_1", transposed=ffn["W_1"].k["transposed"])
            self.use(ffn["W_2"].k["W"], pfx + "W_2", transposed=ffn["W_2"].k["transposed"])
            for name in ("W_1", "W_2", "W_G"):
                lin = ffn[name]
                if lin is None:
                    continue
                if name == "W_G":
                    self.use(lin.k["W"], pfx + "W_G", transposed=lin.k["transposed"])
                if lin.k["b"] is not None:
                    self.use(lin.k["b"], pfx + "b_" + name[2:])
                biases[name[2:]] = lin.k["b"] is not None
            t = ffn["W_1"].k["W"].k["t"]
            types = {n.k["type"] for n in norms}
            eps = {n.k["eps"] for n in norms}
            if len(types) > 1 or len(eps) > 1:
                _refuse(norms[1].node, f"the block's two norms differ (types {types}, eps {eps}); one setting is read")
            affine = {n.k["gamma"] is not None for n in norms}
            if len(affine) > 1:
                _refuse(norms[1].node, "a norm scale on one of the block's norms only")
            for j, n in enumerate(norms, 1):
                if n.k["gamma"] is not None:
                    self.use(n.k["gamma"], f"{pfx}gamma_{j}")
                if n.k["beta"] is not None:
                    self.use(n.k["beta"], f"{pfx}beta_{j}")
                    biases[f"LN{j}"] = True
                elif types == {"layer"}:
                    biases[f"LN{j}"] = False
            opts.update(d_ff=int(t.shape[0] if ffn["W_1"].k["transposed"] else t.shape[1]), norm=f["norm"],
                        activation=ffn["act"], ln_affine=affine.pop(), ln_eps=eps.pop(), norm_type=types.pop(),
                        gated=ffn["W_G"] is not None)
        qkv = {biases[r] for r in "QKV"}
        rest = {b for r, b in biases.items() if r not in "QKV"}
        if len(qkv) > 1:
            _refuse(at, f"biases on some of the Q, K, V projections only ({biases})")
        if rest and len(rest) > 1:
            _refuse(at, f"biases on some layers of the block only ({biases}); the closed form needs all, "
                                "none, or those of Q, K, V only")
        bias = rest == {True} or (not rest and qkv == {True})
        if bias and qkv != {True}:
            _refuse(at, f"biases on the block's other layers but not on Q, K, V ({biases})")
        opts.update(bias=bias, qkv_bias=qkv == {True} and not bias)
        return BlockConfig(**opts)

    def rope_theta(self, r: V, d_k: int) -> float:
        cos, sin = (r.k[n].detach().cpu().to(torch.float64) for n in ("cos", "sin"))
        L = r.node.meta["val"].shape[-2]
        try:
            cos, sin = (t.expand(*t.shape[:-2], L, d_k).reshape(-1, L, d_k) for t in (cos, sin))
        except RuntimeError:
            _refuse(r.node, "rotary tables of another shape than (L, d_k)")
        if not (bool((cos == cos[:1]).all()) and bool((sin == sin[:1]).all())):
            _refuse(r.node, "rotary tables that differ between sequences (position ids other than 0..L-1)")
        cos, sin = cos[0], sin[0]
        theta = 10000.0
        if L > 1 and d_k >= 4:
            f1 = math.atan2(float(sin[1, 1]), float(cos[1, 1]))
            if f1 > 0:
                theta = f1 ** (-d_k / 2)
        want_c, want_s = rope_tables(L, d_k, theta, cos)
        if not (torch.allclose(cos, want_c, rtol=0, atol=1e-12) and torch.allclose(sin, want_s, rtol=0, atol=1e-12)):
            _refuse(r.node, "rotary tables other than the rotate-half tables cos/sin(l theta^(-2i/d_k)) of any theta "
                            "(docs/derivations.md)")
        return float(theta)

    def spec(self) -> dict:
        spec = self.it.spec
        for mname, uses in self.uses.items():
            if len(uses) > 1:
                raise Refused(f"from_torch (traced): the parameter {mname!r} is used as "
                              f"{', '.join(str(u[0]) for u in uses)}: one tensor in two places is read only as the "
                              "tied token embedding and head")
            ours, facts = uses[0]
            names = ours if isinstance(ours, tuple) else (ours,)
            axis = (0 if facts.get("transposed", False) else 1) if facts.get("fused") and len(
                self.it.tensors[mname].shape) == 2 else 0
            spec[mname] = Stored(names, axis, facts.get("transposed", False))
        return spec


# ---------------------------------------------------------------------------------------------- entry point

def _as_tuple(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 1 \
            and isinstance(example_inputs[0], torch.Tensor):
        return tuple(example_inputs)
    raise ValueError(f"from_torch: example_inputs must be one tensor (or a 1-tuple of one), what the module's forward "
                     f"takes first, got {type(example_inputs).__name__}"
                     f"{' of length ' + str(len(example_inputs)) if isinstance(example_inputs, (tuple, list)) else ''}")


@contextlib.contextmanager
def _no_custom_functions():
    """While tracing, a custom ``torch.autograd.Function`` is refused where it is applied: ``torch.export``
    records its forward's operations, but the module's gradient is its own ``backward``, which the closed form
    (the derivative of those operations) would silently replace."""
    saved = torch.autograd.Function.__dict__["apply"]

    def refuse(cls, *args, **kwargs):
        frame = sys._getframe(1)
        raise Refused(f"from_torch (traced): the custom torch.autograd.Function {cls.__qualname__} applied at "
                      f"{frame.f_code.co_filename}:{frame.f_lineno} (in {frame.f_code.co_name}): its backward is its "
                      "own, not the derivative the closed form takes; write its forward with torch operations")

    torch.autograd.Function.apply = classmethod(refuse)
    try:
        yield
    finally:
        torch.autograd.Function.apply = saved


def _float64_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` with its floating parameters and buffers in float64 (ties kept), each tensor
    copied once: the deep copy is handed the float64 tensors instead of copying the module's own."""
    memo = {}
    for p in module.parameters():
        if p.is_floating_point():
            memo[id(p)] = nn.Parameter(p.detach().to(torch.float64, copy=True), requires_grad=p.requires_grad)
    for b in module.buffers():
        if b.is_floating_point():
            memo[id(b)] = b.detach().to(torch.float64, copy=True)
    return copy.deepcopy(module, memo)


def _float64(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64) if x.is_floating_point() else x


def describe(module: nn.Module, example_inputs) -> tuple:
    """``(cfg, spec)`` of ``module`` read by tracing its forward on ``example_inputs`` (module docstring).

    ``example_inputs``: the tensor the module's ``forward`` takes first (token ids ``(B, L)``, images
    ``(B, C, H, W)``, features or hidden states ``(B, L, d)``), or a 1-tuple of it. Raises ``ValueError``
    naming the node (graph name, operator, module path, source line) for a part the closed form does not
    cover, and for a module whose forward differs from the config's by more than :data:`TOLERANCE`."""
    (x,) = _as_tuple(example_inputs)
    m64 = _float64_copy(module)
    x64 = _float64(x)
    try:
        with _no_custom_functions():
            ep = torch.export.export(m64, (x64,), strict=False)
    except Refused:
        raise
    except Exception as e:  # noqa: BLE001 - torch.export's own errors, worded for the user
        raise ValueError(f"from_torch (traced): torch.export could not capture {type(module).__name__}'s forward on "
                         f"the example inputs: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    it = _Interpreter(ep, m64)
    out = it.run()
    parse = _Parse(it)
    cfg = parse.model(out)
    spec = parse.spec()
    for name, _p in m64.named_parameters():
        if name not in spec and name not in it.used:
            spec[name] = Stored(())  # does not reach the output: zero Hessian blocks
    _check_forward(module, m64, cfg, spec, x64)
    _READ[module] = (cfg, spec)
    return cfg, spec


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(torch.finfo(torch.float64).tiny))


def _perturb(p: torch.Tensor, gen: torch.Generator, period: int = 4093) -> None:
    """Add to ``p`` (in place) ``0.1·scale`` times ``N(0, 1)`` draws, ``period`` of them (a prime) repeated over
    its entries (a large tensor is not drawn entry by entry); ``scale`` the standard deviation of ``p``'s first
    ``period`` entries, or 1 where that is 0 (a LayerNorm scale at one)."""
    flat = p.view(-1)
    head = flat[:period]
    scale = float(head.std()) if head.numel() > 1 else 0.0
    draws = 0.1 * (scale or 1.0) * torch.randn(min(period, flat.numel()), generator=gen, dtype=p.dtype)
    whole = flat.numel() // draws.numel() * draws.numel()
    flat[:whole].view(-1, draws.numel()).add_(draws)
    flat[whole:].add_(draws[:flat.numel() - whole])


def _check_forward(module, m64, cfg, spec, x64) -> None:
    """The config's forward against the module's, float64: at the module's parameters on ``x64``, then at
    perturbed parameters on a second random input; ``ValueError`` beyond :data:`TOLERANCE`."""
    from ..model import forward  # the core's forward (adapters import the core, never the reverse)

    gen = torch.Generator().manual_seed(0)
    what = type(module).__name__
    params = read(m64, cfg, spec, torch.float64, copy=False)  # views: they follow the perturbation below
    for trial in range(2):
        if trial:
            with torch.no_grad():
                for p in m64.parameters():
                    if p.is_floating_point():
                        _perturb(p, gen)
            if x64.is_floating_point():
                x64 = torch.randn(x64.shape, generator=gen, dtype=x64.dtype)
            else:
                hi = cfg.vocab if isinstance(cfg, ModelConfig) and cfg.vocab else int(x64.max()) + 1
                x64 = torch.randint(0, hi, x64.shape, generator=gen)
        with torch.no_grad():
            ours = forward(params, x64, cfg)
            theirs = m64(x64)
        if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
            raise ValueError(f"from_torch (traced): {what}'s output {getattr(theirs, 'shape', type(theirs))} is not the "
                             f"shape {tuple(ours.shape)} of the config read ({cfg})")
        err = _relative(ours, theirs)
        if not err <= TOLERANCE:
            at = "its parameters on the example inputs" if not trial else "perturbed parameters on a random input"
            raise ValueError(f"from_torch (traced): {what} computes something else than the config read ({cfg}): "
                             f"relative difference {err:.3g} > {TOLERANCE} at {at} (float64); not read")
