"""blockhess: exact closed-form Jacobians and Hessians of Transformer blocks.

Implements "Closing the Curvature Gap: Full Transformer Hessians" (Petrov, Kiselev,
Meshkov, Grabovoy; arXiv 2510.16927) in PyTorch, checked against ``torch.func``.

>>> import torch, blockhess as bh
>>> cfg = bh.BlockConfig(d_model=4, d_ff=6)
>>> params = bh.init_params(cfg, seed=0)
>>> X = torch.randn(3, 4, dtype=torch.float64)
>>> H = bh.hessian(params, X, cfg, loss="mse", target=torch.zeros(3, 4, dtype=torch.float64))
>>> H.dense().shape
torch.Size([96, 96])
"""

from . import reference
from .adapters import block_input, from_torch, to_module
from .block import input_jacobian, jacobian, second_derivative
from .model import forward
from .result import HessianBlocks
from .layers import attention, ffn, layernorm, softmax
from .config import BlockConfig, ModelConfig, init_params, param_shapes
from .hessian import hessian
from .operators import hessian_operator
from . import operators
from .validation import InsufficientMemoryError
from . import bounds  # noqa: E402  (Theorems 1 and 6; after the core it uses)
from . import convergence  # noqa: E402  (Theorem 7; after the core it uses)

__all__ = [
    "BlockConfig",
    "HessianBlocks",
    "ModelConfig",
    "InsufficientMemoryError",
    "attention",
    "block_input",
    "from_torch",
    "bounds",
    "convergence",
    "ffn",
    "forward",
    "hessian",
    "hessian_operator",
    "operators",
    "init_params",
    "input_jacobian",
    "jacobian",
    "layernorm",
    "param_shapes",
    "reference",
    "second_derivative",
    "softmax",
    "to_module",
]


def _version() -> str:
    """The installed distribution's version (pyproject.toml holds the one copy of it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("blockhess")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


__version__ = _version()
