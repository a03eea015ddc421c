"""docs/layout.md's table is the layering: each row imports only its own row and rows below it.

Every module of the package must sit on a row (a file or a folder named in the first column),
no import, lazy ones inside functions included, may name a module of a row above its own, and no
chain of imports (lazy ones included) may lead from a module back to itself, within a row too; nor,
with each folder of the package one node (a top-level module its own), from a folder back to
itself."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_oases"


def layout_rows():
    """The table's rows, top first, as lists of paths (``megatron_oases/...``)."""
    rows = []
    for line in (ROOT / "docs" / "layout.md").read_text().splitlines():
        if not line.startswith("| `megatron_oases/"):
            continue
        names = re.findall(r"`([^`]+)`", line.split("|")[1])
        base = names[0].rsplit("/", 1)[0] + "/"
        rows.append([n if n.startswith("megatron_oases/") else base + n for n in names])
    return rows


def row_of(rel, rows):
    """The row of a module path: the longest file or folder entry that holds it."""
    best, best_len = None, -1
    for i, row in enumerate(rows):
        for entry in row:
            if (rel == entry or (entry.endswith("/") and rel.startswith(entry))) and len(
                entry
            ) > best_len:
                best, best_len = i, len(entry)
    return best


def resolve(module_file, node):
    """The package files an import names (relative or ``megatron_oases.``), as root paths."""
    if isinstance(node, ast.Import):
        bases = [a.name for a in node.names if a.name.startswith("megatron_oases")]
        subs = [[]] * len(bases)
    else:
        if node.level:
            pkg = module_file.parent.relative_to(ROOT).parts
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + tuple((node.module or "").split(".") if node.module else ()))
        elif (node.module or "").startswith("megatron_oases"):
            base = node.module
        else:
            return []
        bases, subs = [base], [[a.name for a in node.names]]
    out = []
    for base, names in zip(bases, subs):
        path = ROOT.joinpath(*base.split("."))
        targets = [path.with_suffix(".py"), path / "__init__.py"]
        targets += [path / f"{n}.py" for n in names] + [path / n / "__init__.py" for n in names]
        out += [t.relative_to(ROOT).as_posix() for t in targets if t.is_file()]
    return out


def imports_of(path):
    """The package files ``path`` imports, lazy imports inside functions included (itself
    excluded: a package's ``from . import x`` names its own ``__init__``)."""
    rel = path.relative_to(ROOT).as_posix()
    out = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in resolve(path, node):
                if target != rel:
                    out.setdefault(target, node.lineno)
    return out


def import_circle(graph):
    """One circle of ``graph`` (``{module: {imported module: line}}``) as ``[a, b, ..., a]``, or
    None: a depth-first walk that meets a module still on its own path."""
    done, path = set(), []

    def walk(node):
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            found = walk(nxt)
            if found:
                return found
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        found = walk(start)
        if found:
            return found
    return None


def test_every_module_sits_on_a_layout_row():
    rows = layout_rows()
    assert rows, "docs/layout.md has no table rows naming megatron_oases/ paths"
    missing = [
        p.relative_to(ROOT).as_posix()
        for p in sorted(PKG.rglob("*.py"))
        if p != PKG / "__init__.py" and row_of(p.relative_to(ROOT).as_posix(), rows) is None
    ]
    assert not missing, f"add these to docs/layout.md's table: {missing}"


def test_no_import_runs_up_the_layout():
    rows = layout_rows()
    upward = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        mine = row_of(rel, rows)
        if mine is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(path, node):
                    theirs = row_of(target, rows)
                    if theirs is not None and theirs < mine:
                        upward.append(f"{rel}:{node.lineno} -> {target}")
    assert not upward, "imports from a row above (docs/layout.md):\n" + "\n".join(upward)


def test_no_import_circle():
    """The rows' order cannot see a circle inside one row (planner/settings.py -> api.py ->
    build.py -> settings.py sat in the planner/ row): the whole package's import graph, lazy
    imports included, has none."""
    graph = {p.relative_to(ROOT).as_posix(): imports_of(p) for p in sorted(PKG.rglob("*.py"))}
    circle = import_circle(graph)
    assert circle is None, "import circle:\n" + "\n".join(
        f"{a}:{graph[a][b]} -> {b}" for a, b in zip(circle, circle[1:])
    )


def room_of(rel):
    """The folder-level node of module ``rel``: its folder of the package
    (``megatron_oases/planner/``) or, for a top-level module, the module itself."""
    parts = rel.split("/")
    return rel if len(parts) == 2 else "/".join(parts[:2]) + "/"


def folder_graph(graph):
    """``graph`` (``{module: {imported module: line}}``) between folders: ``{room: {room: one
    import that joins them, as "file:line -> file"}}``; imports inside one folder left out."""
    rooms = {}
    for a, targets in graph.items():
        for b, line in targets.items():
            if room_of(a) != room_of(b):
                rooms.setdefault(room_of(a), {}).setdefault(room_of(b), f"{a}:{line} -> {b}")
    return rooms


def test_no_import_circle_between_folders():
    """The rows may place two modules of one folder at different heights (the planner's core
    sat below config.py, its command and cluster search above compare/): every file import ran
    down its rows while config.py -> planner/ -> compare/ -> config.py closed a circle between
    folders. With each folder one node (each top-level module its own), the graph has none."""
    graph = {p.relative_to(ROOT).as_posix(): imports_of(p) for p in sorted(PKG.rglob("*.py"))}
    rooms = folder_graph(graph)
    circle = import_circle(rooms)
    assert circle is None, "import circle between folders:\n" + "\n".join(
        rooms[a][b] for a, b in zip(circle, circle[1:])
    )


def test_the_folder_graph_joins_folders_not_files():
    """The check itself: files of one folder are one node; a top-level module is its own."""
    graph = {
        "megatron_oases/config.py": {"megatron_oases/planner/settings.py": 3},
        "megatron_oases/planner/cli.py": {"megatron_oases/compare/session.py": 5},
        "megatron_oases/planner/settings.py": {"megatron_oases/planner/api.py": 1},
        "megatron_oases/compare/session.py": {"megatron_oases/config.py": 7},
    }
    rooms = folder_graph(graph)
    joined = "megatron_oases/planner/cli.py:5 -> megatron_oases/compare/session.py"
    assert rooms["megatron_oases/planner/"] == {"megatron_oases/compare/": joined}
    assert import_circle(graph) is None  # no file-level circle ...
    assert import_circle(rooms) == [  # ... but one between folders
        "megatron_oases/compare/",
        "megatron_oases/config.py",
        "megatron_oases/planner/",
        "megatron_oases/compare/",
    ]


def test_the_circle_check_finds_a_circle():
    """The check itself: a made-up graph with a circle inside it, and one without."""
    assert import_circle({"a": {"b": 1}, "b": {"c": 1}, "c": {"b": 1}}) == ["b", "c", "b"]
    assert import_circle({"a": {"b": 1, "c": 1}, "b": {"c": 1}, "c": {}}) is None
