"""A result is that of the call (issue 26, "No silent wrong number"): ``bh.hessian``'s ``H``, its lazy
``H.outer`` and ``H.functional``, and ``bh.hessian_operator``'s products ``A @ V`` are computed from a
snapshot taken at the call, for a block, a whole model (``bh.from_torch`` of a PyTorch encoder, GPT-2,
a pooled classifier) and through ``blockhess.distributed``.

Each case makes the result, then changes in place everything the call read: the parameters, the
inputs, the target, a tensor a callable loss closes over and the weights of an ``nn.Module`` head the
loss calls (an optimizer step); only then are the parts first read and the products made. They must
equal a fresh call on the original values (restored in place) to 1e-12 relative (the same operations
on the same numbers: in practice they are equal to the bit). Each change is also shown to matter: a
fresh call on the changed values differs, so a result that read them late would fail.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import blockhess as bh
import blockhess.distributed as bhd

from conftest import make_model_case, rel_err
from settings import NAMED_MODELS

DT = torch.float64
REL = 1e-12  # the same computation on the same values: rounding at most
CHANGED = 1e-6  # a change that matters moves some quantity by more than this (relative)
B, L = 3, 4


class Live:
    """What a call reads and the caller may change after it: ``params``, ``inputs``, ``target``, and for a
    callable loss the tensor ``w`` and the ``nn.Linear`` ``head`` it closes over (``loss``)."""

    def __init__(self, params, inputs, target, width: int | None = None, classes: int = 5, pooled: bool = False,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.params, self.inputs, self.target = params, inputs, target
        self.head = self.w = None
        self.vocab = self.n_classes = None  # the range of integer inputs (token ids) and targets (classes)
        if width is not None:
            self.w = 1 + 0.3 * torch.randn(width, generator=g, dtype=DT)
            self.head = nn.Linear(width, classes, dtype=DT)
            with torch.no_grad():
                self.head.weight.copy_(torch.randn(classes, width, generator=g, dtype=DT))
                self.head.bias.copy_(0.2 * torch.randn(classes, generator=g, dtype=DT))
            head, w = self.head, self.w

            def loss(Z, t):  # one sequence's output; per token (L, width) or pooled (width,)
                logits = head(torch.tanh(Z * w))
                return F.cross_entropy(logits[None] if pooled else logits, t.reshape(-1))

            self.loss = loss
        self._saved = self._state()

    def _state(self):
        tensors = [*self.params.values(), self.inputs, self.target] + ([self.w] if self.w is not None else [])
        return [t.detach().clone() for t in tensors], (
            {k: v.clone() for k, v in self.head.state_dict().items()} if self.head is not None else None)

    def change(self, what: str, seed: int = 1) -> None:
        """Change ``what`` in place: ``"params"``, ``"inputs"``, ``"target"``, ``"closure"`` (the tensor the
        loss closes over), ``"head"`` (an SGD step on the head) or ``"all"`` (each of them there is)."""
        g = torch.Generator().manual_seed(seed)
        every = ("params", "inputs", "target") + (("closure", "head") if self.head is not None else ())
        for part in (every if what == "all" else (what,)):
            if part == "params":
                with torch.no_grad():
                    for v in self.params.values():
                        v.add_(0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype))
            elif part in ("inputs", "target"):
                t = getattr(self, part)
                if t.dtype.is_floating_point:
                    t.add_(0.5 * torch.randn(t.shape, generator=g, dtype=t.dtype))
                else:  # token ids or classes: the next batch written into the same tensor
                    t.copy_((t + 1 + torch.randint(0, 3, t.shape, generator=g)) % self._classes(part))
            elif part == "closure":
                self.w.mul_(1.7).add_(0.2)
            elif part == "head":
                opt = torch.optim.SGD(self.head.parameters(), lr=2.0)
                opt.zero_grad()
                x = torch.randn(7, self.head.in_features, generator=g, dtype=DT)
                F.cross_entropy(self.head(x), torch.randint(0, self.head.out_features, (7,), generator=g)).backward()
                opt.step()

    def _classes(self, part: str) -> int:
        return self.vocab if part == "inputs" else self.n_classes

    def restore(self) -> None:
        tensors, head = self._saved
        with torch.no_grad():
            for t, v in zip([*self.params.values(), self.inputs, self.target] + ([self.w] if self.w is not None else []),
                            tensors):
                t.copy_(v)
        if head is not None:
            self.head.load_state_dict(head)


def _results(live: Live, cfg, loss, hessian=bh.hessian, operator=bh.hessian_operator, V=None):
    """``(H, A, V)`` of the call on the live values now."""
    H = hessian(live.params, live.inputs, cfg, loss=loss, target=live.target)
    A = operator(live.params, live.inputs, cfg, loss=loss, target=live.target)
    if V is None:
        V = torch.randn(A.shape[1], 2, generator=torch.Generator().manual_seed(7), dtype=DT)
    return H, A, V


def _read(H, A, V) -> dict:
    return {"H": H.dense().clone(), "H.outer": H.outer.dense().clone(), "H.functional": H.functional.dense().clone(),
            "A @ V": A @ V}


def assert_snapshot(live: Live, cfg, loss, what: str, **fns) -> None:
    """The results made before ``live.change(what)``, read after it, equal a fresh call on the original
    values; and a fresh call on the changed values differs (the change matters)."""
    H, A, V = _results(live, cfg, loss, **fns)
    live.change(what)
    got = _read(H, A, V)  # the parts first read, the products first made, after the change
    changed = _read(*_results(live, cfg, loss, V=V, **fns))
    live.restore()
    want = _read(*_results(live, cfg, loss, V=V, **fns))
    for k in want:
        assert rel_err(got[k], want[k]) <= REL, f"{k} after changing {what} in place: {rel_err(got[k], want[k]):.3g}"
    assert max(rel_err(changed[k], want[k]) for k in want) > CHANGED, f"changing {what} changes nothing: a weak test"


# ---------------------------------------------------------------------------------------------- a block

BLOCK = bh.BlockConfig(d_model=8, d_ff=12, n_heads=2, norm="pre", activation="gelu", bias=True, out_proj=True,
                       ln_affine=True, ln_eps=1e-5)


def _block(loss: str) -> tuple[Live, object]:
    g = torch.Generator().manual_seed(3)
    p = bh.init_params(BLOCK, seed=1, dtype=DT)
    X = torch.randn(B, L, 8, generator=g, dtype=DT)
    if loss == "mse":
        return Live(p, X, torch.randn(B, L, 8, generator=g, dtype=DT)), "mse"
    live = Live(p, X, torch.randint(0, 5 if loss == "callable" else 8, (B, L), generator=g),
                width=8 if loss == "callable" else None)
    live.n_classes = 5 if loss == "callable" else 8
    return live, (live.loss if loss == "callable" else "ce")


@pytest.mark.parametrize("what", ["params", "inputs", "target", "closure", "head", "all"])
def test_block_result_is_that_of_the_call(what):
    for loss in (("mse", "ce", "callable") if what in ("params", "inputs", "target", "all") else ("callable",)):
        live, fn = _block(loss)
        assert_snapshot(live, BLOCK, fn, what)


# ---------------------------------------------------------------------------------------------- models

def _encoder(loss: str) -> tuple[Live, object, object]:
    """``nn.TransformerEncoder`` (eval) through ``bh.from_torch``: features in, per-token output ``(L, 8)``."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True, dtype=DT)
    model = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8, dtype=DT), enable_nested_tensor=False).eval()
    cfg, p = bh.from_torch(model)
    g = torch.Generator().manual_seed(5)
    X = torch.randn(B, L, 8, generator=g, dtype=DT)
    if loss == "mse":
        return Live(p, X, torch.randn(B, L, 8, generator=g, dtype=DT)), cfg, "mse"
    live = Live(p, X, torch.randint(0, 5, (B, L), generator=g), width=8)
    live.n_classes = 5
    return live, cfg, live.loss


def _gpt2(loss: str) -> tuple[Live, object, object]:
    """The tiny GPT-2 of tests/test_adapters_models.py: ``GPT2LMHeadModel`` with per-token CE on its
    tied head, or ``GPT2Model`` with a callable head on its hidden states."""
    tf = pytest.importorskip("transformers")
    kw = dict(n_embd=8, n_head=2, n_layer=1, vocab_size=16, n_positions=8, n_inner=16, attn_implementation="sdpa",
              bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = (tf.GPT2LMHeadModel if loss == "ce" else tf.GPT2Model)(tf.GPT2Config(**kw)).double().eval()
    with torch.no_grad():  # weights away from the initialisation's near-uniform attention
        for q in model.parameters():
            q.normal_(0, 0.4) if q.ndim > 1 else q.normal_(0, 0.2)
    cfg, p = bh.from_torch(model)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 16, (B, L), generator=g)
    live = Live(p, ids, torch.randint(0, 16 if loss == "ce" else 5, (B, L), generator=g),
                width=None if loss == "ce" else 8)
    live.vocab, live.n_classes = 16, 16 if loss == "ce" else 5
    return live, cfg, "ce" if loss == "ce" else live.loss


def _pooled(loss: str) -> tuple[Live, object, object]:
    """A ViT-like pooled classifier (:data:`settings.NAMED_MODELS` ``"vit"``): CE through its head in
    closed form, or a callable on the pooled output ``(n_out,)``."""
    cfg, p, x, _, y = make_model_case(*NAMED_MODELS["vit"])
    live = Live(p, x, y if loss == "ce" else torch.randint(0, 5, (x.shape[0],)), width=None if loss == "ce" else cfg.n_out,
                pooled=True)
    live.n_classes = cfg.n_out if loss == "ce" else 5
    return live, cfg, "ce" if loss == "ce" else live.loss


MODELS = {"encoder": (_encoder, ("mse", "callable")), "gpt2": (_gpt2, ("ce", "callable")),
          "pooled": (_pooled, ("ce", "callable"))}


@pytest.mark.parametrize("what", ["params", "inputs", "target", "closure", "head", "all"])
@pytest.mark.parametrize("model", list(MODELS))
def test_model_result_is_that_of_the_call(model, what):
    make, loss_names = MODELS[model]
    for loss in (loss_names if what in ("params", "inputs", "target", "all") else ("callable",)):
        live, cfg, fn = make(loss)
        assert_snapshot(live, cfg, fn, what)


@pytest.mark.parametrize("layout", ["a pass per sequence, pairs in one pass", "two passes, pairs in two others"])
def test_model_callable_loss_in_passes_is_that_of_the_call(layout, monkeypatch):
    """A callable loss's derivatives, taken once at the call, give each of several passes its rows
    (the walk's and the weight pairs' own, split differently): the parts of the call, and the
    reference's Hessian."""
    from blockhess.model import walk
    from test_model_hessian import PASS_LAYOUTS, check_against_reference

    monkeypatch.setattr(walk, "_chunks", lambda *args: PASS_LAYOUTS[layout])
    live, cfg, fn = _pooled("callable")
    live.head.requires_grad_(False)  # the reference differentiates the loss: the head as constants
    check_against_reference(cfg, live.params, live.inputs, fn, live.target)
    live.head.requires_grad_(True)
    assert_snapshot(live, cfg, fn, "all")


def test_model_callable_loss_is_called_at_the_call_only():
    """The parts never call a callable loss: its derivatives are the call's."""
    live, cfg, fn = _encoder("callable")
    calls = []

    def counted(Z, t):
        calls.append(1)
        return fn(Z, t)

    H = bh.hessian(live.params, live.inputs, cfg, loss=counted, target=live.target)
    n = len(calls)
    assert n > 0
    _ = H.outer.dense(), H.functional.dense()
    assert len(calls) == n


# ---------------------------------------------------------------------------------------------- distributed

@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["block", "encoder"])
def test_distributed_result_is_that_of_the_call(case, world_of_one):
    """``blockhess.distributed``'s parts (made on first access, collectively) and products, on one rank."""
    if case == "block":
        (live, fn), cfg = _block("callable"), BLOCK
    else:
        live, cfg, fn = _encoder("callable")
    assert_snapshot(live, cfg, fn, "all", hessian=bhd.hessian, operator=bhd.hessian_operator)
