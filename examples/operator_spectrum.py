"""The matrix-free Hessian operator of a GPT-2-style block and its spectrum: exact products A @ v
(never forming n x n), the top eigenvalues of one block by lanczos_eigs (checked against dense eigh of
the same block), and the whole Hessian's spectral density by slq_density; writes OUT/density.png.

    python examples/operator_spectrum.py [OUT]      # OUT defaults to out/examples
"""

import sys
from pathlib import Path

import torch

import blockhess as bh
from blockhess.operators import lanczos_eigs, slq_density

torch.set_num_threads(1)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/examples")
out.mkdir(parents=True, exist_ok=True)

cfg = bh.BlockConfig(d_model=16, d_ff=32, n_heads=2, norm="pre", bias=True, out_proj=True, ln_affine=True,
                     ln_eps=1e-5, activation="gelu_tanh", causal=True)  # a GPT-2 block
params = bh.init_params(cfg, seed=0)
g = torch.Generator().manual_seed(0)
X = torch.randn(4, 8, 16, generator=g, dtype=torch.float64)
y = torch.randint(0, 16, (4, 8), generator=g)  # per-token classes (the block's rows are logits)

A = bh.hessian_operator(params, X, cfg, loss="ce", target=y)  # or part="outer" / "functional"
print(f"operator: n = {A.shape[0]}, blocks {A.names}")
v = torch.randn(A.shape[0], generator=g, dtype=torch.float64)
print("A @ v:", tuple((A @ v).shape), " A @ V (5 vectors at once):", tuple((A @ torch.randn(A.shape[0], 5, dtype=torch.float64)).shape))

B = A["W_1", "W_1"]  # a view: its products compute only W_1's rows
top = lanczos_eigs(B, 3, tol=1e-8)
dense = torch.linalg.eigvalsh(bh.hessian(params, X, cfg, loss="ce", target=y, wrt="W_1").dense())
print(f"W_1 block (n = {B.shape[0]}): top 3 {[f'{x:.6f}' for x in top.eigenvalues.tolist()]} in {top.matvecs} products")
print(f"  dense eigh:              {[f'{x:.6f}' for x in dense.flip(0)[:3].tolist()]}")
print(f"  residuals {[f'{r:.1e}' for r in top.residuals.tolist()]}, converged: {top.converged}")

rho = slq_density(A, n_probes=8, n_iter=32)
print(f"SLQ density: {rho.matvecs} products, grid [{rho.grid[0]:.3f}, {rho.grid[-1]:.3f}], sigma {rho.sigma:.2e}")

import matplotlib  # noqa: E402  (the lab extra; only for the figure)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.semilogy(rho.grid.numpy(), rho.density.clamp_min(1e-8).numpy())
ax.set_xlabel("eigenvalue")
ax.set_ylabel("density")
ax.set_title(f"spectral density of the block's Hessian (SLQ, n = {A.shape[0]})")
fig.tight_layout()
fig.savefig(out / "density.png", dpi=100)
print("wrote", out / "density.png")
