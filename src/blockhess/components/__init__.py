"""Closed-form derivatives of the sub-layers of a Transformer block, one module each.

``softmax`` (§2.1), ``layernorm`` (Theorems 2–3), ``attention`` (§2.2–2.3: G_Q, G_K, G_V,
dF/dX and the contracted second derivatives Φ), ``ffn`` (§2.6: B_1, B_2, J_SY and the FFN's
own second derivatives).
"""
