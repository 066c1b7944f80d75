"""The API reference's build: Sphinx roles become links (docs/hooks/sphinx_roles.py), signatures are formatted,
internals are hidden, and the parameter table of ``CompressedCache`` is complete."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="the docs extra (pip install -e '.[docs]') builds the API reference")

ROOT = Path(__file__).resolve().parents[1]
EXTENSION = ROOT / "docs" / "hooks" / "sphinx_roles.py"

PACKAGE = {
    "__init__.py": (
        '"""Top. :mod:`pkg.sub` holds :class:`~pkg.sub.Thing`; see :func:`helper`."""\n'
        "from pkg.sub import Thing, helper\n"
    ),
    "sub.py": (
        '"""Sub."""\n\nimport difflib\n\n\n'
        "def helper():\n"
        '    """Calls :meth:`Thing.go` and :func:`difflib.get_close_matches`; ``:func:`helper``` stays; '
        ':class:`ImportError`; :func:`the helper <helper>`; :func:`no_such_name`."""\n\n\n'
        "class Thing:\n"
        '    """A thing. :meth:`go` goes, :attr:`size` is its size, :py:class:`pkg.Thing` its alias."""\n\n'
        "    size = 1\n\n"
        "    def go(self):\n"
        '        """Go: :meth:`~pkg.sub.Thing.go` again, and :data:`LIMIT`."""\n\n\n'
        "LIMIT = 3\n"
    ),
}


def _load(root: Path, package: str) -> griffe.Module:
    extensions = griffe.load_extensions(str(EXTENSION))
    return griffe.load(package, search_paths=[str(root)], extensions=extensions, docstring_parser="numpy")


def _link(path: str, text: str) -> str:
    return f'<autoref identifier="{path}" optional><code>{text}</code></autoref>'


def test_roles_resolve_in_the_scope_of_the_documented_object(tmp_path):
    (tmp_path / "pkg").mkdir()
    for name, text in PACKAGE.items():
        (tmp_path / "pkg" / name).write_text(text)
    pkg = _load(tmp_path, "pkg")
    assert pkg.docstring.value == (
        f"Top. {_link('pkg.sub', 'pkg.sub')} holds {_link('pkg.sub.Thing', 'Thing')}; see "
        f"{_link('pkg.sub.helper', 'helper()')}."
    )
    helper = pkg["sub.helper"].docstring.value
    assert helper == (
        f"Calls {_link('pkg.sub.Thing.go', 'Thing.go()')} and `difflib.get_close_matches()`; ``:func:`helper``` "
        f"stays; `ImportError`; {_link('pkg.sub.helper', 'the helper')}; `no_such_name()`."
    )
    thing = pkg["sub.Thing"]
    assert thing.docstring.value == (
        f"A thing. {_link('pkg.sub.Thing.go', 'go()')} goes, {_link('pkg.sub.Thing.size', 'size')} is its size, "
        f"{_link('pkg.sub.Thing', 'pkg.Thing')} its alias."
    )
    assert thing["go"].docstring.value == (
        f"Go: {_link('pkg.sub.Thing.go', 'go()')} again, and {_link('pkg.sub.LIMIT', 'LIMIT')}."
    )


def test_no_role_is_left_in_kvpolicys_docstrings_and_every_link_names_an_object():
    sys.path.insert(0, str(EXTENSION.parent))
    try:
        import sphinx_roles
    finally:
        sys.path.remove(str(EXTENSION.parent))
    pkg = _load(ROOT, "kvpolicy")
    links = 0
    for obj in sphinx_roles.walk(pkg):
        text = obj.docstring.value if obj.docstring else ""
        outside_code = re.sub(r"``.+?``", "", text, flags=re.S)
        assert not sphinx_roles.ROLE.search(outside_code), (obj.path, sphinx_roles.ROLE.search(outside_code))
        for path in re.findall(r'<autoref identifier="([^"]+)" optional>', text):
            pkg.modules_collection.get_member(path)  # KeyError: a link to nothing
            links += 1
    assert links > 500  # about 700 roles name kvpolicy's own objects


def test_compressed_cache_documents_every_parameter_and_every_built_in_name():
    from kvpolicy import registry

    pkg = griffe.load("kvpolicy.cache", search_paths=[str(ROOT)], docstring_parser="numpy")
    cache = pkg["CompressedCache"]
    documented = {}
    for section in cache.docstring.parse("numpy"):
        if section.kind.value == "parameters":
            documented = {p.name.lstrip("*"): p.description for p in section.value}
    signature = [p.name for p in cache["__init__"].parameters if p.name != "self"]
    assert [name for name in signature if name not in documented] == []
    for kind, parameter in (("actions", "action"), ("transforms", "transform"), ("policies", "policy")):
        builtins = [n for n in registry.names(kind) if registry.get(kind, n).__module__.startswith("kvpolicy.")]
        if kind == "policies":
            continue  # the policies are named on their own page; the row says "a registered name"
        missing = [n for n in builtins if f'"{n}"' not in documented[parameter]]
        assert missing == [], (parameter, missing)


def test_the_docs_extra_has_a_signature_formatter_and_the_config_uses_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"(ruff|black)\b", dep) for dep in extras["docs"]), extras["docs"]
    config = (ROOT / "mkdocs.yml").read_text()
    assert "separate_signature: true" in config and re.search(r"line_length: \d+", config)
    assert "- docs/hooks/sphinx_roles.py" in config


def test_the_built_site_has_no_literal_role_and_hides_the_internals(tmp_path):
    pytest.importorskip("mkdocs")
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    pages = {p: p.read_text() for p in site.rglob("*.html")}
    roles = {str(p.relative_to(site)): n for p, t in pages.items() if (n := len(re.findall(r":(func|meth|class):", t)))}
    assert roles == {}
    api = "".join(t for p, t in pages.items() if "reference/api" in p.as_posix())
    internals = (
        "actions.base.DemotedStore.take_first_block",
        "actions.base.DemotedStore.staged_key_positions",
        "formats.base.QTensor.map_batch",
        "cache.CompressedLayer.update",
        "cache.CompressedCache.release_forward",
    )
    assert [name for name in internals if f'id="kvpolicy.{name}"' in api] == []
    assert 'id="kvpolicy.cache.CompressedCache.for_model"' in api  # public methods stay
    assert api.count('class="autorefs autorefs-internal"') > 300
    signature = re.search(r'id="kvpolicy.cache.CompressedCache".*?<pre>(.*?)</pre>', api, re.S)
    assert signature and "\n    policy" in re.sub(r"<[^>]+>", "", signature.group(1))  # one parameter per line
