"""Shipped in overlay wheels as ``apex/_overlay.py``: runs upstream NVIDIA Apex's package inits beside ours.

Where upstream and we both have a package ``__init__.py`` (``apex``, ``apex.optimizers``,
``apex.parallel``, ...), the overlay wheel holds ours, with upstream's kept next to it as
``_upstream_init.py``; our init ends by calling `run_upstream_init`, which executes upstream's
file in the package namespace one top-level statement at a time:

* a statement that only binds names our init already defines is skipped (ours win per name,
  and replaced upstream modules are not imported for nothing);
* any other statement runs; names of ours it rebinds are put back afterwards, ``__all__`` is
  the union (ours first);
* a statement that raises (typically an import of a CUDA-only extension on a machine without
  it, or of an upstream module that relies on internals of a package we replaced) is logged on
  the ``apex.overlay`` logger and recorded in `REPORT`; the rest of the init still runs, so
  one unavailable feature never makes ``import apex`` fail;
* what a statement prints goes to that logger (and `REPORT`) instead of stdout: upstream's
  contrib inits print "apex was installed without --<feature> flag" when their CUDA extension
  is missing, which is untrue in a package whose init is also ours (ours provides the feature).

Only the standard library is used here (no torch import).
"""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
from typing import Dict, List, Set

logger = logging.getLogger("apex.overlay")

# module-level dunders that are ours to keep (upstream's init must not replace our lazy loader or version)
_OUR_DUNDERS = ("__getattr__", "__dir__", "__version__", "__build_variant__")

#: one entry per upstream statement: package, line, status ("ran", "skipped", "failed"), error, what it printed
REPORT: List[Dict[str, object]] = []


def _bound_names(node: ast.AST) -> Set[str]:
    """Names a top-level statement binds in the module namespace (compound statements: their bodies)."""
    names: Set[str] = set()
    if isinstance(node, ast.Import):
        names.update((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom):
        names.update(a.asname or a.name for a in node.names)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    else:
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(node, field, ()) or ():
                names |= _bound_names(child)
    return names


def run_upstream_init(namespace: dict, filename: str = "_upstream_init.py") -> None:
    """Executes upstream's init (kept as `filename` beside the package's ``__init__.py``) in `namespace`."""
    package = namespace.get("__name__", "?")
    path = os.path.join(os.path.dirname(namespace["__file__"]), filename)
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    ours = {k: v for k, v in namespace.items()
            if not (k.startswith("__") and k.endswith("__")) or k in _OUR_DUNDERS}
    our_all = list(namespace.get("__all__", []))
    for node in tree.body:
        names = _bound_names(node)
        line = getattr(node, "lineno", 0)
        if names and names <= set(ours):
            REPORT.append({"package": package, "line": line, "status": "skipped", "error": None})
            continue
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
        except Exception as exc:  # an unavailable upstream feature must not break `import apex`
            REPORT.append({"package": package, "line": line, "status": "failed",
                           "error": f"{type(exc).__name__}: {exc}", "printed": printed.getvalue()})
            logger.info("apex overlay: %s line %d of upstream's init not available here (%s: %s)",
                        package, line, type(exc).__name__, exc)
        else:
            REPORT.append({"package": package, "line": line, "status": "ran", "error": None,
                           "printed": printed.getvalue()})
        finally:
            if printed.getvalue():
                logger.info("apex overlay: %s line %d of upstream's init printed: %s", package, line,
                            printed.getvalue().strip())
            for name, value in ours.items():  # ours win per name
                if namespace.get(name, value) is not value:
                    namespace[name] = value
            if our_all and list(namespace.get("__all__", [])) != our_all:
                extra = [n for n in namespace.get("__all__", []) if n not in our_all]
                namespace["__all__"] = our_all + extra
