"""The path of a request within the app, as the app's routes match it: without the prefix an embedder mounted the
app under (``parent.mount("/kiln", app)`` puts ``/kiln`` in the scope's ``root_path``, and in its ``path`` too)."""

from __future__ import annotations

from starlette.types import Scope


def route_path(scope: Scope) -> str:
    """``scope``'s path less its ``root_path`` where the path holds it (as Starlette's routing reads it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path
