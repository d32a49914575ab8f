"""Renders the Sphinx markup of normhooks' docstrings in the Markdown that mkdocstrings reads.

The docstrings are Google style, but STYLE.md puts formulas in ``.. math::`` blocks and the
text refers to objects with Sphinx roles (``:func:`lars_```); mkdocstrings understands
neither and would print them verbatim. This extension rewrites them before the docstrings
are parsed: a ``.. math::`` block becomes a fenced LaTeX block (the site has no math
renderer, because it must build and read offline), ``:math:`x``` an inline code span, and a
role such as ``:class:`~torch.amp.GradScaler``` the object's name in code (without the
module when Sphinx's ``~`` asks for that). Roles become text, not links: several name
private or external objects (``GradientHook``, torch's classes) that the site does not
document, and an unresolved link would fail the strict build.

It also renames the ``Example:`` sections that STYLE.md asks for to ``Examples:``: griffe's
Google parser knows only the plural (napoleon knows both) and would otherwise render the
doctest as prose, its output lines as Markdown.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|obj|data|exc):`(~?)([^`]+)`")
_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_MATH_BLOCK = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*\n")
_EXAMPLE = re.compile(r"^([ \t]*)Example:[ \t]*$", flags=re.MULTILINE)


def _role(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def _math_blocks(text: str) -> str:
    """Each ``.. math::`` directive and its indented body become a fenced latex block."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _MATH_BLOCK.match(lines[i] + "\n")
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent = match.group("indent")
        body: list[str] = []
        i += 1
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)
        ):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        formula = textwrap.dedent("\n".join(body)).strip("\n")
        out.extend([f"{indent}```latex", *textwrap.indent(formula, indent).splitlines()])
        out.extend([f"{indent}```", ""])
    return "\n".join(out)


def rewrite(text: str) -> str:
    """The docstring ``text`` with its Sphinx markup rewritten in Markdown."""
    text = _EXAMPLE.sub(r"\1Examples:", _math_blocks(text))
    text = _MATH_ROLE.sub(r"`\1`", text)
    return _ROLE.sub(_role, text)


class SphinxMarkup(griffe.Extension):
    """Rewrites every docstring once the package is loaded, before mkdocstrings parses it."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rewrite(obj.docstring.value)
