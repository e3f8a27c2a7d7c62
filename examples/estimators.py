"""Trace and diagonal estimators on the matrix-free operator, each against the exact value from the
dense Hessian: Hutch++ (hutchpp_trace), Hutchinson's diagonal (hutchinson_diagonal), the exact diagonal
in closed form (diagonal / A.diagonal()), the Frobenius norm, and per_block for every block at once.

    python examples/estimators.py
"""

import torch

import blockhess as bh
from blockhess.operators import diagonal, frobenius_norm, hutchinson_diagonal, hutchpp_trace, lanczos_eigs, per_block

torch.set_num_threads(1)
cfg = bh.BlockConfig(d_model=8, d_ff=16, n_heads=2, ln_eps=1e-5)
params = bh.init_params(cfg, seed=0)
g = torch.Generator().manual_seed(0)
X = torch.randn(4, 6, 8, generator=g, dtype=torch.float64)
T = torch.randn(4, 6, 8, generator=g, dtype=torch.float64)

A = bh.hessian_operator(params, X, cfg, loss="mse", target=T)
H = bh.hessian(params, X, cfg, loss="mse", target=T).dense()  # small enough to check against
print(f"n = {A.shape[0]}")

tr = hutchpp_trace(A, 60)
print(f"trace: Hutch++ {tr.value:.5f} ± {tr.stderr:.5f} ({tr.matvecs} products); exact {H.trace():.5f}, "
      f"{abs(tr.value - H.trace()) / tr.stderr:.1f} standard errors off")  # an indefinite H: trace small against ‖H‖_F

est = hutchinson_diagonal(A, 60)
exact = diagonal(A)  # the closed form (docs/derivations.md §19), no sampling
print(f"diagonal: closed form against dense, max |diff| {(exact - H.diagonal()).abs().max():.1e}")
print(f"          Hutchinson (60 products): relative error {(est.value - exact).norm() / exact.norm():.2f}")

fro = frobenius_norm(A, 60)
print(f"Frobenius norm: {fro.value:.4f} ± {fro.stderr:.4f}; exact {H.norm():.4f}")

tops = per_block(A, lanczos_eigs, k=1, tol=1e-8)  # each block's own top eigenvalue
for name, res in tops.items():
    print(f"  {name}: top eigenvalue {res.eigenvalues[0]:.6f} ({res.matvecs} products)")
