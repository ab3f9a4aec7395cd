"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``).

The docstrings use Sphinx roles (``:class:`Claim```); mkdocstrings renders the role's text as it
is, so the API pages would show ``:class:`` before every name. The role is dropped here (the name
stays code), and a leading ``~`` too.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):<code>~?")


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub("<code>", html)
