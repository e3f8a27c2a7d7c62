"""The digits ViT of `make run`: a one-block Vision Transformer on scikit-learn's bundled 8x8 digits,
trained here in seconds (or read from OUT/digits_vit.pt), then the exact Hessian of its loss w.r.t.
every parameter on 16 training images and w.r.t. the block alone; writes OUT/digits_vit_hessian.png.

Needs the lab extra (pip install 'blockhess[lab]').

    python examples/digits_vit.py [OUT]      # OUT defaults to out/examples
"""

import sys
from pathlib import Path

import torch

import blockhess as bh
from blockhess.linalg import rel_error
from blockhess_lab.vit import load_or_train

torch.set_num_threads(1)
out = Path(sys.argv[1] if len(sys.argv) > 1 else "out/examples")
out.mkdir(parents=True, exist_ok=True)

vit = load_or_train(out / "digits_vit.pt")  # trains 2,000 AdamW steps (seed 0) when the file is absent
print(f"test accuracy {vit.test_accuracy:.4f} on {len(vit.test_labels)} images")
images, labels = vit.train_images[:16], vit.train_labels[:16]

H = bh.hessian(vit.params, vit.model_inputs(images), vit.model_cfg, loss="ce", target=labels)  # every weight
print(f"whole model: n = {H.dense().shape[0]}, variables {list(H.names)}")
ev = torch.linalg.eigvalsh(H.dense())
print(f"  eigenvalues in [{ev[0]:.3e}, {ev[-1]:.3e}], {int((ev < -1e-10 * ev.abs().max()).sum())} below -1e-10 ‖H‖₂")

Hb = bh.hessian(vit.block_params(), vit.embed(images), vit.cfg, loss=vit.head_loss, target=labels)  # the block alone
names = [f"blocks.0.{n}" for n in Hb.names]
Hw = bh.hessian(vit.params, vit.model_inputs(images), vit.model_cfg, loss="ce", target=labels, wrt=names)
print(f"the block alone: n = {Hb.dense().shape[0]}; the whole model's blocks.0 part equals it to "
      f"{rel_error(Hw.dense(), Hb.dense()):.1e}")

import matplotlib  # noqa: E402  (the lab extra)

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(5.5, 4.6))
im = ax.imshow(torch.log10(H.dense().abs() + 1e-12).numpy(), cmap="magma")
ax.set_title("log10 |H| of the digits ViT, every parameter (16 images)")
fig.colorbar(im, ax=ax)
fig.tight_layout()
fig.savefig(out / "digits_vit_hessian.png", dpi=100)
print("wrote", out / "digits_vit_hessian.png")
