"""What a Python source file imports, read statically: the purity and layering tests' one
reader of import statements."""

from __future__ import annotations

import ast


def imported_roots(source: str) -> set[str]:
    """Top-level names of every module ``source`` imports, wherever the import sits."""
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                roots.add(node.args[0].value.split(".")[0])
    return roots
