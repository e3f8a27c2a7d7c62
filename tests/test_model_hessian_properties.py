"""Property-based tests of whole models: random :class:`~blockhess.ModelConfig` options (every one of
:data:`settings.MODEL_OPTIONS`: embedding, cls token, positions, token types, both LayerNorms and
their ``gamma``, ``beta`` and eps, pooling, head none / linear / tied, its bias, the loss), 1–3
blocks each with its own options (every one of :data:`settings.BLOCK_OPTIONS`), tokens ``L >= 1``,
batches of 1–3 sequences, an input scale, the seed of the weights, and the parameters asked for
(all, or a random subset). The closed form is checked against :func:`blockhess.reference.hessian`
in float64 by the suite's rules (conftest.py): the full Hessian to ``1e-10`` of its norm, each of
its blocks to its own, the outer and functional parts in units of the whole, each allowed
autograd's own measured error (:func:`conftest.autograd_defect`); and the identities (symmetry,
``outer + functional = full``, a PSD outer term for CE and MSE). Profiles: conftest.py.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

import blockhess as bh

from conftest import (assert_close, assert_identities, assert_part_close, autograd_defect, fro, make_model_case)
from settings import BLOCK_OPTIONS, MODEL_OPTIONS, model_valid

# the sizes the draws take beyond MODEL_OPTIONS' (kept small: 100 examples in the fast profile)
DRAWN_SIZES = {"n_blocks": [1, 2, 3], "d_model": [4, 4, 6], "tokens": [1, 2, 3], "batch": [1, 2]}
LN_EPS = [0.0, 1e-12, 1e-5, 1e-2]  # a block's ln_eps (BLOCK_OPTIONS has two)


@st.composite
def model_cases(draw):
    options = {k: st.sampled_from(DRAWN_SIZES.get(k, v)) for k, v in MODEL_OPTIONS.items()}
    row = draw(st.fixed_dictionaries(options).filter(model_valid))
    block = st.fixed_dictionaries({**{k: st.sampled_from(v) for k, v in BLOCK_OPTIONS.items()},
                                   "ln_eps": st.sampled_from(LN_EPS)})
    blocks = draw(st.lists(block, min_size=row["n_blocks"], max_size=row["n_blocks"]))
    seed = draw(st.integers(0, 2**16))
    scale = 10.0 ** draw(st.floats(-0.5, 0.5))
    names = list(make_model_case(row, blocks)[1])
    wrt = draw(st.one_of(st.none(), st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True)))
    return dict(row=row, blocks=blocks, seed=seed, scale=scale, wrt=wrt)


@given(model_cases())
def test_closed_form_against_autograd(case):
    cfg, p, x, loss, T = make_model_case(case["row"], case["blocks"], seed=case["seed"], scale=case["scale"])
    wrt = case["wrt"]
    H = bh.hessian(p, x, cfg, loss=loss, target=T, wrt=wrt)
    R = bh.reference.hessian(p, x, cfg, loss=loss, target=T, wrt=wrt)
    assert H.names == R.names
    D, defect = R.dense(), autograd_defect(R.dense())  # allow: autograd's own (measured) error
    # the whole for the rounding of a block that is zero (a key bias: softmax ignores it) is the model's
    # whole Hessian, whatever wrt selects
    s = fro(D) if wrt is None else fro(bh.reference.hessian(p, x, cfg, loss=loss, target=T).dense())
    assert_close(H.dense(), D, scale=s, what="full", allow=defect)
    for a in H.names:  # every block, cross-layer ones included, to its own norm (or the whole's rounding)
        for b in H.names:
            assert_close(H[a, b], R[a, b], scale=s, what=f"block ({a}, {b})", allow=defect)
    # the parts in units of the whole: the reference's functional term is full − outer
    assert_part_close(H.outer.dense(), R.outer.dense(), s, what="outer", allow=defect)
    assert_part_close(H.functional.dense(), R.functional.dense(), s, what="functional", allow=defect)
    assert_identities(H, convex=case["row"]["loss"] in ("ce", "mse"), reference=R, what="closed form")
