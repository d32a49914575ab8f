"""The package's imports run one way: no module imports, at any depth, one that imports it.

Read from the source (imports inside functions included, where the kernels are imported on
first use), not from ``sys.modules``, so that a circle that Python resolves at run time by
importing late is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """Each normhooks module and the normhooks modules it imports (a package's ``__init__``
    is the package itself; ``from package import module`` imports the module)."""
    modules = {module_name(path): path for path in (SOURCE / "normhooks").rglob("*.py")}
    found: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    targets.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        found[name] = {t for t in targets if t in modules and t != name}
    return found


def test_no_module_imports_one_that_imports_it() -> None:
    graph = imports()
    # The package re-exports the public names, so it imports every technique, and code built
    # on the public API (the demo) imports it: left out, only real circles count.
    graph.pop("normhooks")
    circles = []
    for start in graph:
        reached, frontier = set(), list(graph[start])
        while frontier:
            module = frontier.pop()
            if module in reached or module not in graph:
                continue
            reached.add(module)
            frontier.extend(graph[module])
        if start in reached:
            circles.append(start)
    assert circles == []
