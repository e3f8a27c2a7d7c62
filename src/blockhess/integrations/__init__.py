"""Bridges to other libraries, each imported only by its user (nothing in blockhess imports them).

* :mod:`.laplace`: ``BlockhessGGN`` and ``BlockhessHessian``, exact curvature backends for
  laplace-torch (``pip install --no-deps -r requirements-laplace.txt``; docs/guide/laplace.md).
"""
