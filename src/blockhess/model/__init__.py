r"""A whole Transformer: embedding -> ``N`` blocks -> final LayerNorm -> pooling -> head, and the exact
Hessian of its loss w.r.t. any of its parameters by curvature back-propagation over its stages
(docs/derivations.md §16).

* :mod:`.forward_pass`: input checks, the forward pass and its :class:`~.forward_pass.Trace`;
* :mod:`.stages`: each stage's first and second derivatives (embedding, LayerNorm, pooling, head,
  a block through :mod:`blockhess.block`, the loss at the output);
* :mod:`.walk`: the backward walk that assembles every block of the Hessian, cross-layer ones included.
"""

from __future__ import annotations

import torch

from ..block import forward as block_forward
from ..config import BlockConfig, ModelConfig
from .forward_pass import forward as model_forward

__all__ = ["forward"]


def forward(params: dict[str, torch.Tensor], inputs: torch.Tensor, cfg: BlockConfig | ModelConfig) -> torch.Tensor:
    """The output of a block (:func:`blockhess.block.forward`, ``cfg`` a :class:`~blockhess.BlockConfig`)
    or of a model (:func:`.forward_pass.forward`, ``cfg`` a :class:`~blockhess.config.ModelConfig`)."""
    if isinstance(cfg, ModelConfig):
        return model_forward(params, inputs, cfg)
    return block_forward(params, inputs, cfg)
