"""Griffe extension: turn the Sphinx roles of kvpolicy's docstrings into cross-reference links at build time.

kvpolicy's docstrings are NumPy-style and name other objects with Sphinx roles (``:func:`plan```,
``:class:`~kvpolicy.spec.CacheSpec```, ``:meth:`CompressedCache.save```). mkdocstrings renders Markdown,
so without this extension each role would print as literal text. The extension rewrites every role in every
docstring of the package mkdocstrings loads, before rendering:

- the target is resolved as Sphinx would: in the scope of the documented object (its members, then its
  parents' members and the names its module imports), else as a full dotted path;
- a target that resolves to an object of the loaded package becomes an *optional* autorefs reference
  (``<autoref identifier="kvpolicy.spec.CacheSpec" optional>``): a link where that object is rendered on
  some page, the name in code font where it is not (an internal helper), never a warning;
- anything else (``:class:`ImportError```, ``:func:`difflib.get_close_matches```, a name that does not
  resolve) becomes the name in code font;
- the text shown follows Sphinx: ``~a.b.c`` shows ``c``, ``title <target>`` shows ``title``, and
  functions and methods get ``()``.

Roles inside a double-backtick code span are left as written. Nothing in the package itself changes: this runs
only when the docs are built (``mkdocs.yml``: ``extensions: [docs/hooks/sphinx_roles.py]``).
"""

from __future__ import annotations

import contextlib
import html
import re
from typing import Any

import griffe

#: a role: ``:func:`target```, ``:py:meth:`~a.b```, ``:class:`title <target>```
ROLE = re.compile(r":(?:py:)?(?P<kind>func|meth|class|mod|attr|data|obj|exc|const|any):`(?P<body>[^`]+)`")
#: a role, or a double-backtick code span (whose text, roles included, is left as written)
TOKEN = re.compile(rf"(?P<code>``.+?``)|{ROLE.pattern}", re.S)
#: roles whose display text Sphinx ends with ``()``
CALLABLE = {"func", "meth"}


def display_and_target(kind: str, body: str) -> tuple[str, str]:
    """The text a role shows and the target it names: ``("c()", "a.b.c")`` for ``:func:`~a.b.c```."""
    body = body.strip()
    titled = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", body, re.S)
    if titled:
        return titled["title"].strip(), titled["target"].strip().lstrip("~.")
    short = body.startswith("~")
    target = body.lstrip("~").lstrip(".").removesuffix("()")
    text = target.rsplit(".", 1)[-1] if short else target
    if kind in CALLABLE:
        text += "()"
    return text, target


def resolve(obj: griffe.Object, target: str, collection: griffe.ModulesCollection) -> str | None:
    """The full path of ``target`` as named in ``obj``'s docstring, when it is an object of the loaded
    package (an alias resolves to the object it stands for); ``None`` otherwise."""
    head, _, rest = target.partition(".")
    candidates = []
    with contextlib.suppress(griffe.NameResolutionError, griffe.AliasResolutionError, KeyError, ValueError):
        candidates.append(obj.resolve(head) + (f".{rest}" if rest else ""))
    candidates.append(target)
    for path in candidates:
        try:
            found = collection.get_member(path)
        except (KeyError, ValueError, AttributeError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        try:
            return found.final_target.path if found.is_alias else found.path
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue  # an alias to another package (torch, transformers): not rendered here
    return None


def rewrite(text: str, obj: griffe.Object, collection: griffe.ModulesCollection) -> str:
    """``text`` (a docstring) with each role outside code spans replaced as the module docstring says."""

    def replace(match: re.Match[str]) -> str:
        shown, target = display_and_target(match["kind"], match["body"])
        path = resolve(obj, target, collection)
        code = f"<code>{html.escape(shown)}</code>"
        if path is None:
            return f"`{shown}`" if "`" not in shown else code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    return TOKEN.sub(lambda m: m["code"] or replace(m), text)


def walk(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every member below it that is defined in the package (aliases skipped: their target is
    visited where it is defined)."""
    out = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            out += walk(member)  # type: ignore[arg-type]
    return out


class SphinxRoles(griffe.Extension):
    """Rewrite the Sphinx roles of every docstring of a loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for obj in walk(pkg):
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite(obj.docstring.value, obj, loader.modules_collection)
