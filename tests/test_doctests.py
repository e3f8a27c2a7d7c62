"""The examples in the docstrings run and print what they say."""

import doctest

import pytest

import blockhess
from blockhess import convergence


@pytest.mark.parametrize("module", [blockhess, convergence], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, verbose=False)
    assert result.attempted > 0 and result.failed == 0
