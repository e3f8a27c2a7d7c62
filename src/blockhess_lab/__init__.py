"""blockhess_lab: the research harness beside the library, the paper's experiments and the command line.

:mod:`blockhess` is the library (torch, numpy and psutil only, and it never imports this package);
this package drives it: the digits ViT (:mod:`.vit`), the ``blockhess`` command line (:mod:`.cli`)
and one module per subcommand (``report``, ``bounds``, ``scaling``, ``convergence``, ``validate``,
``bench``), with what they share (:mod:`.runtime`, :mod:`.outputs`, :mod:`.plots`). It needs the
``lab`` extra: ``pip install 'blockhess[lab]'`` (matplotlib, scikit-learn, SciPy, tqdm).

A command module defines ``HELP`` (one line: the command's entry in ``blockhess --help`` and the
first line of its own ``--help``), ``add_arguments(parser)`` and ``run(args) -> int``, and
optionally ``DETAILS`` (a paragraph its ``--help`` shows after the options).
"""
