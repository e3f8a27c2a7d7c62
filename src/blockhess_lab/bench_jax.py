"""The paper's block and losses in ``jax.numpy``, for the JAX baseline of ``blockhess bench``.

Mirrors :func:`blockhess.reference.forward` line by line (post-LN block, one head, no
biases, ``eps`` LayerNorm without affine, ReLU) so that ``jax.jit(jax.hessian(...))`` computes
the same matrix as :func:`blockhess.hessian`. Parameters travel as one flat vector ``theta``
whose pieces are the weights in canonical order, each in row-major order (``vec_r``), so
the Hessian comes out as the dense ``(n, n)`` matrix in the layout of ``HessianBlocks.dense()``.

Importing this module switches JAX to float64 (``jax_enable_x64``); it is imported only
by benchmark worker processes. Requires ``jax`` (the ``bench`` extra).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", True)

__all__ = ["unflatten", "forward", "loss_fn", "make_hessian"]


def unflatten(theta, shapes):
    """``{name: W}`` from the flat vector ``theta``; ``shapes`` is ``[(name, shape), ...]``."""
    out, o = {}, 0
    for name, shape in shapes:
        size = math.prod(shape)
        out[name] = theta[o : o + size].reshape(shape)
        o += size
    return out


def _layer_norm(x, eps):
    m = x - x.mean(-1, keepdims=True)
    return m / jnp.sqrt((m * m).mean(-1, keepdims=True) + eps)


def forward(p: dict, X, eps: float = 0.0, kind: str = "block"):
    """``Z`` of the post-LN block (or ``F`` of the bare attention layer); ``X`` ``(..., L, d)``."""
    dk = p["W_Q"].shape[1]
    T = (X @ p["W_Q"]) @ jnp.swapaxes(X @ p["W_K"], -1, -2) / math.sqrt(dk)
    F = jax.nn.softmax(T, axis=-1) @ (X @ p["W_V"])
    if kind == "attention":
        return F
    Y = _layer_norm(X + F, eps)
    return _layer_norm(Y + jnp.maximum(Y @ p["W_1"], 0.0) @ p["W_2"], eps)


def _ce(logits, target):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, target[..., None], axis=-1).mean()


def loss_fn(loss: str, Z, target, head=None):
    """The batch loss of ``Z`` ``(B, L, d)``: ``"mse"`` (mean over entries), ``"ce"`` (rows of
    ``Z`` are logits, mean over tokens), ``"digits"`` (mean-pooled tokens times ``head``,
    cross-entropy over the sequences' labels)."""
    if loss == "mse":
        return ((Z - target) ** 2).mean()
    if loss == "ce":
        return _ce(Z, target)
    if loss == "digits":
        return _ce(Z.mean(-2) @ head, target)
    raise ValueError(f"unknown loss {loss!r}")


def make_hessian(shapes, loss: str, eps: float = 0.0, kind: str = "block"):
    """``jax.jit(jax.hessian(f))`` of ``f(theta, X, target, head) = loss(forward(theta, X))``."""

    def f(theta, X, target, head):
        return loss_fn(loss, forward(unflatten(theta, shapes), X, eps, kind), target, head)

    return jax.jit(jax.hessian(f, argnums=0))
