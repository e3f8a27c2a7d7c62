"""A block's exact Hessian and its parts: the paper's post-LN block, an MSE loss, every weight.

Prints the blocks' shapes, the Gauss-Newton (outer) and functional parts, their extreme eigenvalues and
the agreement with autograd (blockhess.reference); writes the Hessian's heat map to OUT/block_hessian.png.

    python examples/block_hessian.py [OUT]      # OUT defaults to out/examples
"""

import sys
from pathlib import Path

import torch

import blockhess as bh
from blockhess.linalg import rel_error

torch.set_num_threads(1)  # small products: one thread is fastest, and shared cores stay free
out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/examples")
out.mkdir(parents=True, exist_ok=True)

cfg = bh.BlockConfig(d_model=8, d_ff=16, ln_eps=1e-5)  # one head, ReLU, no biases: the paper's block
params = bh.init_params(cfg, seed=0)  # {"W_Q", "W_K", "W_V", "W_1", "W_2"}, float64
g = torch.Generator().manual_seed(0)
X = torch.randn(4, 6, 8, generator=g, dtype=torch.float64)  # 4 sequences of L = 6 tokens
T = torch.randn(4, 6, 8, generator=g, dtype=torch.float64)  # MSE targets

H = bh.hessian(params, X, cfg, loss="mse", target=T)
print("variables and sizes:", dict(zip(H.names, H.sizes)))
print("H[W_Q, W_V]:", tuple(H["W_Q", "W_V"].shape))
full, outer, functional = H.dense(), H.outer.dense(), H.functional.dense()
print(f"n = {full.shape[0]}; full = outer + functional to {rel_error(outer + functional, full):.1e}")
for name, M in (("full", full), ("outer", outer), ("functional", functional)):
    ev = torch.linalg.eigvalsh(M)
    print(f"{name:>10}: eigenvalues in [{ev[0]:.3e}, {ev[-1]:.3e}], {int((ev < -1e-12 * ev.abs().max()).sum())} negative")

R = bh.reference.hessian(params, X, cfg, loss="mse", target=T)  # torch.func on plain ops, float64
print(f"relative error against autograd: {rel_error(full, R.dense()):.1e}")

import matplotlib  # noqa: E402  (the lab extra; only for the figure)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(5, 4.2))
im = ax.imshow(torch.log10(full.abs() + 1e-12).numpy(), cmap="viridis")
ends = torch.tensor(H.sizes).cumsum(0).tolist()  # each variable's block ends here
for e in ends[:-1]:
    ax.axhline(e - 0.5, color="w", lw=0.6)
    ax.axvline(e - 0.5, color="w", lw=0.6)
centres = [e - s / 2 for e, s in zip(ends, H.sizes)]
ax.set_xticks(centres, H.names)
ax.set_yticks(centres, H.names)
ax.set_title("log10 |H| of the block (MSE)")
fig.colorbar(im, ax=ax)
fig.tight_layout()
fig.savefig(out / "block_hessian.png", dpi=100)
print("wrote", out / "block_hessian.png")
