"""MkDocs hooks of the documentation site (mkdocs.yml ``hooks:``).

The changelog page includes CHANGELOG.md (its ``--8<-- "CHANGELOG.md"`` line, the snippets
syntax), expanded here rather than by pymdownx.snippets because its links are written from the
top of the repository (``docs/sql.md``) and on the site they are relative to docs/: ``docs/`` is
dropped before MkDocs checks them.

The docstrings use Sphinx roles (``:class:`Claim```); mkdocstrings renders the role's text as it
is, so the API pages would show ``:class:`` before every name. The role is dropped here (the name
stays code), and a leading ``~`` too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

CHANGELOG = Path(__file__).resolve().parent / "CHANGELOG.md"
INCLUDE_CHANGELOG = '--8<-- "CHANGELOG.md"'

REPO_DOCS_LINK = re.compile(r"\]\(docs/")
ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|exc|data|obj|const):<code>~?")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if INCLUDE_CHANGELOG not in markdown:
        return markdown
    return markdown.replace(INCLUDE_CHANGELOG, REPO_DOCS_LINK.sub("](", CHANGELOG.read_text()))


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub("<code>", html)
