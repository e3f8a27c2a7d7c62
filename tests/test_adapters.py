"""blockhess.adapters on real PyTorch layers: ``bh.from_torch(nn.TransformerEncoderLayer)`` reproduces
``layer(X)`` to 1e-12, and ``H.to_module(layer)`` equals ``torch.func.hessian`` of the layer's
loss through ``torch.func.functional_call`` w.r.t. its own named parameters, to 1e-10.

PyTorch computes the attention with ``scaled_dot_product_attention``, whose CPU flash kernel
has no forward-mode AD; ``torch.func.hessian`` (forward over reverse) therefore runs under
``sdpa_kernel(SDPBackend.MATH)``. In torch 2.13 the double backward of ``F.layer_norm``'s
*weight* gradient w.r.t. its input is wrong, so torch's ``H[norm*.weight, θ]`` for ``θ``
upstream of that LayerNorm (the lower triangle in parameter order) is wrong while its
transpose ``H[θ, norm*.weight]`` is right (checked against finite differences, and here
against the upper triangle); docs/derivations.md §9. We compare every block of the upper
triangle and every lower block except those rows.
"""

import re
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import blockhess as bh

from conftest import TOL, assert_blocks_close, assert_close, fro, rounding

DT = torch.float64


def make_layer(norm_first, activation, bias, nhead, eps, batch_first, d=8, dff=6, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d, nhead, dff, dropout=0.1, activation=activation, layer_norm_eps=eps,
                                       batch_first=batch_first, norm_first=norm_first, bias=bias, dtype=DT)
    with torch.no_grad():  # LayerNorm scales away from 1, biases away from 0
        for n, p in layer.named_parameters():
            if n.startswith("norm") and n.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.3 * torch.randn_like(p))
    return layer.eval()


# (norm_first, activation, bias, nhead, layer_norm_eps, batch_first)
CONFIGS = [
    (False, "relu", True, 1, 1e-5, True),
    (True, "gelu", True, 2, 1e-3, False),
    (False, F.gelu, False, 4, 1e-5, True),
    (True, F.relu, False, 2, 1e-3, True),
    (False, nn.GELU(approximate="tanh"), True, 4, 1e-3, False),
    (True, nn.ReLU(), True, 4, 1e-5, True),
    (False, nn.GELU(), True, 2, 1e-3, True),
    (True, functools.partial(F.gelu, approximate="tanh"), False, 1, 1e-5, False),
]
IDS = [f"{'pre' if c[0] else 'post'}-{getattr(c[1], '__name__', type(c[1]).__name__) if not isinstance(c[1], str) else c[1]}"
       f"-{'bias' if c[2] else 'nobias'}-H{c[3]}-eps{c[4]:g}-{'bf' if c[5] else 'sf'}" for c in CONFIGS]


def _module_hessian(layer, Xm, T, **kw):
    mp = {k: v.detach() for k, v in layer.named_parameters()}

    def loss(q):
        return ((torch.func.functional_call(layer, q, (Xm,), kw) - T) ** 2).mean()

    with sdpa_kernel([SDPBackend.MATH]):
        return mp, torch.func.hessian(loss)(mp)


def _compare(Hm, mp, Hr):
    names = list(mp)
    assert list(Hm.names) == names
    up_num = up_den = 0.0
    lower = {}
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            R = Hr[a][b].reshape(mp[a].numel(), mp[b].numel())
            assert Hm[a, b].shape == R.shape
            if j >= i:
                up_num += ((Hm[a, b] - R) ** 2).sum().item()
                up_den += (R ** 2).sum().item()
            elif not a.startswith("norm") or not a.endswith("weight"):
                lower[(a, b)] = (Hm[a, b], R)
    assert (up_num / up_den) ** 0.5 <= TOL
    # the lower blocks one by one, where torch.func is right (not a LayerNorm weight's row); zero ones to the whole's rounding
    whole = (up_den + sum(fro(R) ** 2 for _, R in lower.values())) ** 0.5
    for key, (got, want) in lower.items():
        assert_close(got, want, scale=whole, what=f"lower {key}")
    D = Hm.dense()
    assert fro(D - D.T) <= rounding(D) * fro(D)


@pytest.mark.parametrize("cfg_args", CONFIGS, ids=IDS)
def test_forward_and_module_hessian(cfg_args):
    layer = make_layer(*cfg_args)
    B, L, d = 2, 3, 8
    g = torch.Generator().manual_seed(1)
    Xm = torch.randn((B, L, d) if cfg_args[5] else (L, B, d), generator=g, dtype=DT)
    T = torch.randn(Xm.shape, generator=g, dtype=DT)
    cfg, p = bh.from_torch(layer)
    assert cfg.norm == ("pre" if cfg_args[0] else "post") and cfg.n_heads == cfg_args[3] and cfg.bias == cfg_args[2]
    assert cfg.ln_eps == cfg_args[4] and cfg.out_proj and cfg.ln_affine
    X = bh.block_input(layer, Xm)
    with torch.no_grad():
        Ym = layer(Xm)
    assert_close(bh.forward(p, X, cfg), bh.block_input(layer, Ym), what="forward")
    H = bh.hessian(p, X, cfg, loss="mse", target=bh.block_input(layer, T))
    mp, Hr = _module_hessian(layer, Xm, T)
    _compare(H.to_module(layer), mp, Hr)


def test_outer_functional_and_unbatched_input():
    layer = make_layer(True, "gelu", True, 2, 1e-5, True)
    Xm = torch.randn(4, 8, dtype=DT)  # one unbatched sequence
    T = torch.randn(4, 8, dtype=DT)
    cfg, p = bh.from_torch(layer)
    H = bh.hessian(p, Xm, cfg, loss="mse", target=T)
    Hm = H.to_module(layer)
    assert_close(Hm.outer.dense() + Hm.functional.dense(), Hm.dense(), what="outer + functional")
    mp, Hr = _module_hessian(layer, Xm, T)
    _compare(Hm, mp, Hr)
    # a Hessian over some weights maps to the module parameters it covers
    part = bh.hessian(p, Xm, cfg, loss="mse", target=T, wrt=["W_1", "b_1", "gamma_2"]).to_module(layer)
    assert part.names == ("linear1.weight", "linear1.bias", "norm2.weight")
    assert_close(part["linear1.weight", "norm2.weight"], Hm["linear1.weight", "norm2.weight"], what="wrt subset")


def test_a_layer_inside_a_stack():
    """Layer 0 of a two-layer nn.TransformerEncoder with a classifier head: the rest of the network
    is the callable loss of layer 0's output; against autograd through the whole model."""
    d, L, B, C = 4, 3, 2, 3
    g = torch.Generator().manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 2, 6, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False).double().eval()
    head = nn.Linear(d, C).double()  # parameters left requiring grad, as in a model being trained
    first, rest = enc.layers
    X = torch.randn(B, L, d, dtype=DT, generator=g)
    y = torch.randint(0, C, (B,), generator=g)

    def loss(Z, t):  # one sequence's output of layer 0
        return F.cross_entropy(head(rest(Z[None]).mean(1)), t[None])

    cfg, p = bh.from_torch(first)
    with warnings.catch_warnings(), sdpa_kernel(SDPBackend.FLASH_ATTENTION), \
            pytest.raises(ValueError, match=r"sdpa_kernel\(SDPBackend.MATH\)"):
        warnings.simplefilter("ignore", UserWarning)  # torch: no batching rule for the fused kernel
        bh.hessian(p, X, cfg, loss=loss, target=y)
    names = [n for n, _ in first.named_parameters()]

    def whole(*ws):
        Z = torch.func.functional_call(first, dict(zip(names, ws)), (X,))
        return F.cross_entropy(head(rest(Z).mean(1)), y)

    with sdpa_kernel(SDPBackend.MATH):
        H = bh.hessian(p, X, cfg, loss=loss, target=y).to_module(first)
        R = torch.autograd.functional.hessian(whole, tuple(first.get_parameter(n).detach() for n in names))
    assert list(H.names) == names
    size = [first.get_parameter(n).numel() for n in names]
    Rd = torch.cat([torch.cat([R[i][j].reshape(size[i], size[j]) for j in range(len(names))], 1) for i in range(len(names))])
    assert_close(H.dense(), Rd, what="layer 0 of a stack")


@pytest.mark.parametrize("as_mask", [False, True])
def test_causal(as_mask):
    layer = make_layer(False, "relu", True, 2, 1e-5, True)
    L = 4
    Xm = torch.randn(2, L, 8, dtype=DT)
    T = torch.randn(2, L, 8, dtype=DT)
    mask = nn.Transformer.generate_square_subsequent_mask(L, dtype=DT)
    cfg, p = bh.from_torch(layer, src_mask=mask) if as_mask else bh.from_torch(layer, is_causal=True)
    assert cfg.causal
    with torch.no_grad():
        Ym = layer(Xm, src_mask=mask, is_causal=True)
    assert_close(bh.forward(p, Xm, cfg), Ym, what="causal forward")
    H = bh.hessian(p, Xm, cfg, loss="mse", target=T).to_module(layer)
    mp, Hr = _module_hessian(layer, Xm, T, src_mask=mask, is_causal=True)
    _compare(H, mp, Hr)
    bool_mask = torch.ones(L, L, dtype=torch.bool).triu(1)
    assert bh.from_torch(layer, src_mask=bool_mask)[0].causal


def test_multihead_attention_alone():
    torch.manual_seed(3)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, dtype=DT).eval()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    Xm = torch.randn(2, 3, 8, dtype=DT)
    T = torch.randn(2, 3, 8, dtype=DT)
    cfg, p = bh.from_torch(mha)
    assert cfg.kind == "attention" and cfg.out_proj and cfg.bias
    with torch.no_grad():
        Ym = mha(Xm, Xm, Xm, need_weights=False)[0]
    assert_close(bh.forward(p, Xm, cfg), Ym, what="MHA forward")
    mp = {k: v.detach() for k, v in mha.named_parameters()}

    def loss(q):
        return ((torch.func.functional_call(mha, q, (Xm, Xm, Xm), {"need_weights": False})[0] - T) ** 2).mean()

    with sdpa_kernel([SDPBackend.MATH]):
        Hr = torch.func.hessian(loss)(mp)
    Hm = bh.hessian(p, Xm, cfg, loss="mse", target=T).to_module(mha)
    # every block to its own norm; zero ones (the key bias's: softmax is shift invariant) to the whole's rounding
    assert_blocks_close({(a, b): (Hm[a, b], Hr[a][b].reshape(Hm[a, b].shape)) for a in mp for b in mp}, what="MHA")


def test_unsupported_settings_are_named():
    layer = make_layer(False, "relu", True, 2, 1e-5, True)
    with pytest.raises(ValueError, match=r"dropout=0.1 in training mode"):
        bh.from_torch(layer.train())
    layer.eval()
    nodrop = nn.TransformerEncoderLayer(8, 2, 6, dropout=0.0, dtype=DT).train()
    assert bh.from_torch(nodrop)[0].activation == "relu"  # dropout 0 in training mode is fine
    with pytest.raises(ValueError, match="custom activation"):
        bh.from_torch(nn.TransformerEncoderLayer(8, 2, 6, activation=lambda x: torch.tanh(x), dtype=DT).eval())
    with pytest.raises(ValueError, match="custom activation"):
        bh.from_torch(nn.TransformerEncoderLayer(8, 2, 6, activation=nn.SiLU(), dtype=DT).eval())
    odd = make_layer(False, "relu", True, 2, 1e-5, True)
    odd.self_attn = nn.MultiheadAttention(8, 2, kdim=5, vdim=5, batch_first=True, dtype=DT)
    with pytest.raises(ValueError, match="kdim/vdim=5/5 != d_model=8"):
        bh.from_torch(odd)
    odd.self_attn = nn.MultiheadAttention(8, 2, add_bias_kv=True, batch_first=True, dtype=DT)
    with pytest.raises(ValueError, match="add_bias_kv"):
        bh.from_torch(odd)
    with pytest.raises(ValueError, match="src_mask: only the causal mask"):
        bh.from_torch(layer, src_mask=torch.zeros(3, 3, dtype=DT))
    pads = torch.zeros(2, 3, dtype=torch.bool)
    assert bh.from_torch(layer, src_key_padding_mask=pads)[0] == bh.from_torch(layer)[0]  # pads nothing: no change
    assert bh.from_torch(layer, src_key_padding_mask=pads.to(DT))[0] == bh.from_torch(layer)[0]  # additive, all 0
    pads[1, 2] = True
    for mask in (pads, pads.to(DT).masked_fill(pads, float("-inf"))):
        with pytest.raises(ValueError, match=r"src_key_padding_mask: a mask that pads is not supported.*at its own length"):
            bh.from_torch(layer, src_key_padding_mask=mask)
    other = make_layer(False, "relu", True, 2, 1e-5, True)
    other.norm2.eps = 1e-3
    with pytest.raises(ValueError, match="layer_norm_eps: norm1.eps=1e-05 != norm2.eps=0.001"):
        bh.from_torch(other)
    with pytest.raises(ValueError, match="supports nn.TransformerEncoderLayer"):
        bh.from_torch(nn.Linear(3, 3))
    cfg, p = bh.from_torch(layer)
    H = bh.hessian(p, torch.randn(3, 8, dtype=DT), cfg, target=torch.zeros(3, 8, dtype=DT), wrt="W_1")
    with pytest.raises(ValueError, match=r"H is the Hessian of another architecture than module TransformerEncoderLayer "
                                         r"\(H's vs the module's: d_ff: 6 vs 5\)"):
        H.to_module(make_layer(False, "relu", True, 2, 1e-5, True, dff=5))
    H.cfg = None  # a Hessian that does not say whose it is: the shapes still have to agree
    with pytest.raises(ValueError, match=r"linear1.weight: shape \(5, 8\) does not match the Hessian's \(6, 8\)"):
        H.to_module(make_layer(False, "relu", True, 2, 1e-5, True, dff=5))
    mcfg, mp = bh.from_torch(nn.MultiheadAttention(8, 2, batch_first=True, dtype=DT))
    Hm = bh.hessian(mp, torch.randn(3, 8, dtype=DT), mcfg, target=torch.zeros(3, 8, dtype=DT))
    with pytest.raises(ValueError, match="than module TransformerEncoderLayer .*kind: 'attention' vs 'block'"):
        Hm.to_module(layer)  # the attention layer's names are a subset of the block's, its numbers are not
    part = bh.hessian(p, torch.randn(3, 8, dtype=DT), cfg, target=torch.zeros(3, 8, dtype=DT), wrt=["W_Q", "W_1"])
    with pytest.raises(ValueError, match=r"self_attn.in_proj_weight stores W_Q, W_K, W_V together, but this Hessian has only W_Q"):
        part.to_module(layer)
    ours = bh.BlockConfig(d_model=8, n_heads=2, kind="attention", bias=True, out_proj=True)  # d_k, d_ff left to defaults
    Ho = bh.hessian(mp, torch.randn(3, 8, dtype=DT), ours, target=torch.zeros(3, 8, dtype=DT))
    assert Ho.to_module(nn.MultiheadAttention(8, 2, batch_first=True, dtype=DT)).names[0] == "in_proj_weight"
    training = make_layer(False, "relu", True, 2, 1e-5, True).train()  # dropout 0.1: from_torch refuses it, to_module need not
    Hl = bh.hessian(p, torch.randn(3, 8, dtype=DT), cfg, target=torch.zeros(3, 8, dtype=DT), wrt="W_1")
    assert Hl.to_module(training).names == ("linear1.weight",)
    part2 = bh.hessian(p, torch.randn(3, 8, dtype=DT), cfg, target=torch.zeros(3, 8, dtype=DT), wrt=["W_Q", "W_K"])
    with pytest.raises(ValueError, match="has only W_Q, W_K:"):
        part2.to_module(layer)
    with pytest.raises(ValueError, match="block_input supports nn.TransformerEncoderLayer and nn.MultiheadAttention, nn.TransformerEncoder "
                                         "and Hugging Face's blocks, got Linear"):
        bh.block_input(nn.Linear(8, 8), torch.randn(3, 8, dtype=DT))
    with pytest.raises(ValueError, match="from_torch: dtype must be float32 or float64, got torch.float16"):
        bh.from_torch(layer, dtype=torch.float16)


def test_to_module_refuses_every_structural_mismatch():
    layer = make_layer(False, "relu", True, 2, 1e-5, True)
    cfg, p = bh.from_torch(layer)
    X = torch.randn(3, 8, dtype=DT)
    H = bh.hessian(p, X, cfg, target=torch.zeros(3, 8, dtype=DT), wrt="W_1")
    others = [make_layer(True, "relu", True, 2, 1e-5, True), make_layer(False, "gelu", True, 2, 1e-5, True),
              make_layer(False, "relu", True, 2, 1e-3, True), make_layer(False, "relu", True, 4, 1e-5, True),
              make_layer(False, "relu", False, 2, 1e-5, True)]
    fields = ["norm: 'post' vs 'pre'", "activation: 'relu' vs 'gelu'", "ln_eps: 1e-05 vs 0.001", "n_heads: 2 vs 4",
              "bias: True vs False"]
    for other, field in zip(others, fields):  # pre-LN, activation, eps, heads, biases: the one field named
        with pytest.raises(ValueError, match=r"H's vs the module's: ([^)]*; )?" + re.escape(field)):
            H.to_module(other)


def test_from_torch_dropout_and_bias_checks():
    with pytest.raises(ValueError, match="dropout=0.1 in training mode"):
        bh.from_torch(nn.MultiheadAttention(8, 2, dropout=0.1, dtype=DT))
    for name, where in (("self_attn.dropout", "self_attn"), ("dropout1.p", "dropout1")):
        layer = nn.TransformerEncoderLayer(8, 2, 6, dropout=0.0, dtype=DT).train()
        if where == "self_attn":
            layer.self_attn.dropout = 0.2
        else:
            layer.dropout1.p = 0.2
        with pytest.raises(ValueError, match=f"{name}=0.2 in training mode"):
            bh.from_torch(layer)
    mha = nn.MultiheadAttention(8, 2, dtype=DT)
    mha.out_proj.bias = None
    with pytest.raises(ValueError, match="in_proj_bias and out_proj.bias must both be present"):
        bh.from_torch(mha)
