"""The shape of the code (docs/architecture.md): a model family is one folder.

* Outside ``library/families/`` no code names a family: identifiers and string literals (docstrings and comments may
  give examples) hold no family word. The exceptions are sd-scripts' entry scripts at the repository root and the
  thin family-named shims users type or run (``networks.lora_flux``, ``tools/merge_sd3_safetensors.py`` ...).
* ``library/`` never imports ``networks/`` (the adapter layer builds on the library).
* No import circle between packages (imports inside functions count; so do ``TYPE_CHECKING`` ones).
* A family folder imports no other family folder.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("library", "networks", "tools", "finetune")
FAMILY_WORDS = re.compile(
    r"(?<![a-z0-9])(sd1|sd2|sdxl|sd3|sd35|sd3\.5|sd 1|sd 2|flux|schnell|chroma|t5xxl|t5|clip_l|clip_g|mmdit|bfl|"
    r"lumina|anima|hunyuan|qwen|zimage|z_image|z image|pixart|cascade|wuerstchen|gemma)(?![a-z0-9])",
    re.IGNORECASE,
)
SHIM_LINES = 40  # a family-named file outside the family folder is a shim: a docstring and a few lines


def _python_files(*folders: str) -> Iterator[Path]:
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    """Ids of the string constants that are docstrings (of a module, class, function or attribute)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.add(id(node.value))
    return out


def family_words(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier or string literal of ``path`` that holds a family word."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        texts: list[str] = []
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            texts.append(node.value)
        elif isinstance(node, ast.Name):
            texts.append(node.id)
        elif isinstance(node, ast.Attribute):
            texts.append(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            texts.append(node.name)
        elif isinstance(node, ast.alias):
            texts += [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            texts.append(node.module or "")
        elif isinstance(node, (ast.arg, ast.keyword)):
            texts.append(node.arg or "")
        for text in texts:
            if FAMILY_WORDS.search(text.replace("_", " ")) or FAMILY_WORDS.search(text):
                found.append((getattr(node, "lineno", 0), text[:80]))
    return found


def _code_lines(path: Path) -> int:
    """Lines of code (no blank lines, comments or docstrings)."""
    tree = ast.parse(path.read_text())
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    lines = path.read_text().splitlines()
    return sum(1 for i, line in enumerate(lines, 1) if line.strip() and not line.strip().startswith("#")
               and i not in doc_lines)  # fmt: skip


def test_no_code_outside_the_family_folders_names_a_family():
    offenders = {}
    for path in _python_files(*CODE):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("library", "families"):
            continue
        if FAMILY_WORDS.search(path.stem.replace("_", " ")):  # a family-named shim: must stay thin
            if _code_lines(path) > SHIM_LINES:
                offenders[str(rel)] = [
                    f"a family-named shim of {_code_lines(path)} lines of code (at most {SHIM_LINES})"
                ]
            continue
        words = family_words(path)
        if words:
            offenders[str(rel)] = words[:5]
    assert not offenders, "family names outside library/families/ (ask the family or the registry):\n" + "\n".join(
        f"  {k}: {v}" for k, v in offenders.items()
    )


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """(module, level) of every import in ``path`` (relative ones resolved), TYPE_CHECKING ones included."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if path.name == "__init__.py":
        package = package.removesuffix(".__init__")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base, node.lineno
            for alias in node.names:  # ``from pkg import module``
                yield f"{base}.{alias.name}", node.lineno


def test_the_library_never_imports_networks():
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in _python_files("library") for m, line in _imports(p)
           if m == "networks" or m.startswith("networks.")]  # fmt: skip
    assert not bad, "\n".join(bad)


def _package_of(module: str, packages: set[str]) -> str | None:
    while module and module not in packages:
        module = module.rpartition(".")[0]
    return module or None


def _package_graph() -> dict[str, set[str]]:
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in _python_files(*CODE) if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {p: set() for p in packages}
    for path in _python_files(*CODE):
        own = _package_of(".".join(path.parent.relative_to(ROOT).parts), packages)
        for module, _ in _imports(path):
            other = _package_of(module, packages)
            if own and other and other != own:
                graph[own].add(other)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_between_packages():
    cycles = _cycles(_package_graph())
    assert not cycles, f"import circles between packages: {cycles}"


def _module_graph() -> dict[str, set[str]]:
    modules = {}
    for path in _python_files(*CODE):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for module, _ in _imports(path):
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module != name and not name.startswith(module + "."):  # a package's own __init__
                graph[name].add(module)
    return graph


def test_no_import_circle_between_modules():
    """Within a package too: no module imports one that imports it back (a package importing its own __init__ is
    not counted)."""
    cycles = _cycles(_module_graph())
    assert not cycles, f"import circles between modules: {cycles}"


def test_a_family_folder_imports_no_other_family_folder():
    families = ROOT / "library" / "families"
    folders = {p.parent.name for p in families.glob("*/__init__.py") if "FAMILIES" in p.read_text()}
    assert {"sd", "flux", "sd3"} <= folders  # the shared folders (encoders, autoencoders) are not family folders
    bad = []
    for folder in folders:
        for path in (families / folder).rglob("*.py"):
            for module, line in _imports(path):
                parts = module.split(".")
                if parts[:2] == ["library", "families"] and len(parts) > 2 and parts[2] in folders - {folder}:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_checks_find_what_they_look_for(tmp_path):
    """The checks above are not vacuous: a family word in a string or a name is found, a docstring is not, and a
    circle is a circle."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""A FLUX example in a docstring."""\nflux_weight = 1\nNAME = "sdxl"\n')
    assert [text for _, text in family_words(probe)] == ["flux_weight", "sdxl"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
