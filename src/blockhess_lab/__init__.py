"""Drivers behind the command line: each module adds one ``blockhess`` subcommand.

A module here defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``, and
optionally ``DESCRIPTION`` (the subcommand's ``--help`` text; ``HELP`` when absent).
"""
