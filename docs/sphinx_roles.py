"""A griffe extension for the API reference: mptex's docstrings cross-reference with Sphinx roles
(``:class:`~mptex.HashGridEncoding```), which Markdown would print as they are. Each role becomes
inline code of the name a reader sees (the last component where Sphinx's ``~`` asks for it)."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|obj|exc):`(~?)([^`]+)`")


def _plain(match: re.Match) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)
