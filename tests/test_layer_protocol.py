"""Every layer module follows its contract in blockhess.layers.protocol: the functions are there,
take the arguments in the order the contract names, and return what it says."""

from __future__ import annotations

import inspect

import pytest
import torch

from blockhess.layers import attention, ffn, layernorm, protocol, softmax
from blockhess.result import BlockSum


def _first_params(fn, k: int) -> list[str]:
    return list(inspect.signature(fn).parameters)[:k]


@pytest.mark.parametrize("module", [softmax, layernorm])
def test_maps_follow_the_map_contract(module):
    assert isinstance(module, protocol.Map)
    assert not isinstance(module, protocol.Layer)  # no weights, no cache
    x = _first_params(module.jacobian, 1)  # every derivative at the same point (softmax: its output A)
    assert _first_params(module.hessian, 1) == x
    assert len(_first_params(module.forward, 1)) == 1
    for name in ("contract_hessian", "contract_hessian_unchecked"):
        assert _first_params(getattr(module, name), 2)[0] == x[0], name
    for name in ("jacobian", "hessian"):
        assert "compact" in inspect.signature(getattr(module, name)).parameters, name


@pytest.mark.parametrize("module", [attention, ffn])
def test_layers_follow_the_layer_contract(module):
    assert isinstance(module, protocol.Layer)
    assert issubclass(module.Cache, tuple) and module.Cache._fields  # a NamedTuple
    for name in ("weight_jacobians", "input_jacobian", "contract_hessian"):
        assert _first_params(getattr(module, name), 1) == ["c"], name
    assert _first_params(module.contract_hessian, 4) == ["c", "G" if module is attention else "g", "acc", "names"]
    assert _first_params(module.weight_jacobians, 2) == ["c", "names"]
    assert isinstance(module.NAMES, tuple) and module.NAMES
    # the directional derivatives of a matrix-free product: at the cache, with the weights and their directions
    assert _first_params(module.tangent, 3) == ["c", "p", "dp"]
    assert _first_params(module.adjoint, 1) == ["c"]
    assert _first_params(module.second_adjoint, 5) == ["c", "p", "dp", "a", "t"]
    assert issubclass(module.Tangent, tuple) and issubclass(module.Adjoint, tuple)


def test_a_module_without_the_functions_is_refused():  # the isinstance checks above can fail
    assert not isinstance(torch, protocol.Layer)
    assert not isinstance(inspect, protocol.Map)


def _case():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 3, 4, dtype=torch.float64, generator=g)
    W = {k: torch.randn(*s, dtype=torch.float64, generator=g) / 2 for k, s in
         {"W_Q": (4, 2), "W_K": (4, 2), "W_V": (4, 4), "W_1": (4, 5), "W_2": (5, 4)}.items()}
    return X, W


def test_layers_return_one_convention():
    """forward -> the layer's Cache; weight_jacobians -> {name: TokenKron}; contract_hessian -> a
    Contraction, the blocks among the layer's own weights added to acc."""
    X, W = _case()
    c_att = attention.forward(X, W["W_Q"], W["W_K"], W["W_V"])
    c_ffn = ffn.forward(X.reshape(6, 4), W["W_1"], W["W_2"], act="gelu")
    assert isinstance(c_att, attention.Cache) and isinstance(c_ffn, ffn.Cache)
    for module, c, G, names in ((attention, c_att, torch.ones_like(c_att.F), attention.NAMES),
                                (ffn, c_ffn, torch.ones_like(c_ffn.S), ("W_1", "b_1", "W_2"))):
        J = module.weight_jacobians(c, names if module is attention else ("W_1", "W_2"))
        assert set(J) <= set(names) and J
        shapes = {"W_Q": (4, 2), "W_K": (4, 2), "W_V": (4, 4), "W_1": (4, 5), "b_1": (5,), "W_2": (5, 4)}
        acc = BlockSum(names, {n: shapes[n] for n in names})
        con = module.contract_hessian(c, G, acc, names)
        assert isinstance(con, protocol.Contraction)
        assert acc.blocks  # the layer's own blocks went to acc
        if module is ffn:  # gelu: the activation's curvature w.r.t. Y and its cores are left to the caller
            assert con.gamma.shape == (6, 4, 4) and con.core and con.cross
            assert ("W_1", "W_2") in acc.blocks and ("b_1", "W_2") in acc.blocks
