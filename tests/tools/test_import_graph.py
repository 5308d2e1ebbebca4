"""The host package's import graph (read from the source, every import statement, top-level or
inside a function): no cycle among replayssm_cute's modules, and no module imports another
module's underscore names (what modules share is public in the module that owns it)."""

import ast

from tests.helpers import ROOT

PACKAGES = ((ROOT / "src" / "replayssm_cute", "replayssm_cute"), (ROOT / "kernels", "replayssm_cute.kernels"))


def _modules():
    """{module name: (path, is_package)} of replayssm_cute and its kernels."""
    mods = {}
    for base, pkg in PACKAGES:
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if "__pycache__" in path.parts or (pkg == "replayssm_cute" and parts[0] == "kernels"):
                continue
            is_pkg = parts[-1] == "__init__"
            mods[".".join([pkg] + (parts[:-1] if is_pkg else parts))] = (path, is_pkg)
    return mods


def _imports(mods):
    """(edges {module: {module it imports}}, [(module, imported module, private name)])."""
    edges, private = {m: set() for m in mods}, []

    def owner(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                targets = [(f"{source}.{a.name}", a.name) if f"{source}.{a.name}" in mods else (source, a.name)
                           for a in node.names]
            else:
                continue
            for target, name in targets:
                target = owner(target)
                if not target or target == mod:
                    continue
                edges[mod].add(target)
                if name and name.startswith("_") and not name.startswith("__"):
                    private.append((mod, target, name))
    return edges, private


def _cycles(edges):
    """Strongly connected components of more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read():
    mods = _modules()
    edges, _ = _imports(mods)
    assert "replayssm_cute.api" in mods and "replayssm_cute.kernels.mamba2.decode" in mods
    assert "replayssm_cute.runtime.launch" in edges["replayssm_cute.api"] | {
        t for m in edges["replayssm_cute.api"] for t in edges[m]}


def test_no_import_cycle():
    assert _cycles(_imports(_modules())[0]) == []


def test_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_private_name_crosses_modules():
    assert _imports(_modules())[1] == []
