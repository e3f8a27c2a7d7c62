"""The layers of a Transformer block, one module each with every derivative order of it.

``softmax`` (§2.1), ``layernorm`` (Theorems 2–3), ``attention`` (§2.2–2.3: G_Q, G_K, G_V,
dF/dX and the contracted second derivatives Φ), ``ffn`` (§2.6: B_1, B_2, J_SY and the FFN's
own second derivatives), each with its directional derivatives for a matrix-free product beside
them; and ``linear``, the affine map of the projections (its tangent and second-order adjoint only).
Each module has one name, ``blockhess.layers.<layer>``; ``blockhess`` re-exports the four layers'
module objects themselves (``blockhess.layernorm is blockhess.layers.layernorm``).
The functions each layer provides and their return conventions, written down once:
:mod:`blockhess.layers.protocol`.
"""
