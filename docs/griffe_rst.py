"""A Griffe extension for the API reference (mkdocs.yml): the docstrings are NumPy-style with reST
roles; this turns what Markdown would show raw into Markdown, before mkdocstrings renders them.

- ``:func:`~blockhess.x.y` `` and the other roles (class, mod, meth, attr, data, exc, obj) become a
  code span, ``y`` (the last part for ``~``, the whole path otherwise);
- ``:math:`x` `` becomes ``$x$`` and a ``.. math::`` directive's indented body a ``$$ ... $$`` block,
  which pymdownx.arithmatex hands to MathJax.

The docstrings themselves are unchanged (``help()`` and the tests read them as written).
"""

from __future__ import annotations

import re
import textwrap

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([^`]+)`")
MATH = re.compile(r":math:`([^`]+)`")


def _role(m: re.Match) -> str:
    tilde, target = m.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def _math_blocks(text: str) -> str:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == ".. math::":
            indent = len(line) - len(line.lstrip())
            body, i = [], i + 1
            while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
                body.append(lines[i])
                i += 1
            while body and not body[-1].strip():
                body.pop()
            pad = " " * indent
            out += [pad + "$$", *(pad + b for b in textwrap.dedent("\n".join(body)).strip("\n").splitlines()), pad + "$$", ""]
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def markdown(text: str) -> str:
    """``text`` with its reST roles and math directives as Markdown."""
    return ROLE.sub(_role, MATH.sub(lambda m: f"${m.group(1)}$", _math_blocks(text)))


class RestToMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
