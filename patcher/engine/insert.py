"""Stage 4's last touch: the imports the steps asked for, written after the module's import block.

LibCST's ``AddImportsVisitor`` does the same with a second parse-and-metadata pass; this scans only the
top-level statements of the module the steps already rewrote.
"""

from __future__ import annotations

from .packages import BOTH


def insert_imports(module, items, in_package=False):
    """Add the imports steps asked for (LibCST ``ImportItem``s) after the module's import block. With ``in_package`` ``BOTH`` (``packages.py``) the runtime's
    import is the ``try: from . import ...`` / ``except ImportError: import ...`` block, which a later run
    finds again as the import it is.
    """
    import libcst as cst

    from .codemods.base import RUNTIME_MODULE, dotted, runtime_import_block

    if not items:
        return module
    have: set[tuple[str, str | None]] = set()
    after = 0  # insert after the docstring, __future__ imports and the import block
    for i, stmt in enumerate(module.body):
        if isinstance(stmt, cst.Try) and RUNTIME_MODULE in dotted_imports(stmt):
            have.update({(RUNTIME_MODULE, None), (".", RUNTIME_MODULE)})
            after = i + 1
            continue
        if not isinstance(stmt, cst.SimpleStatementLine):
            break
        small = stmt.body[0]
        if isinstance(small, cst.Import):
            have.update((dotted(a.name) or "", None) for a in small.names)
        elif isinstance(small, cst.ImportFrom):
            mod = "." * len(small.relative) + (dotted(small.module) if small.module else "")
            names = [] if isinstance(small.names, cst.ImportStar) else [dotted(a.name) for a in small.names]
            have.update((mod, n) for n in names)
        elif not (i == 0 and isinstance(small, cst.Expr) and isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString))):
            break
        after = i + 1
    new_lines = []
    for item in items:
        key = (item.module, item.obj_name)
        if key in have:
            continue
        have.add(key)
        if in_package == BOTH and item.module == RUNTIME_MODULE and item.obj_name is None:
            new_lines.append(runtime_import_block())
        elif item.obj_name is None:
            new_lines.append(cst.parse_statement(f"import {item.module_name}" + (f" as {item.alias}" if item.alias else "")))
        else:
            text = f"from {item.module} import {item.obj_name}" + (f" as {item.alias}" if item.alias else "")
            new_lines.append(cst.parse_statement(text))
    if not new_lines:
        return module
    body = list(module.body)
    if after < len(body) and not body[after].leading_lines:
        body[after] = body[after].with_changes(leading_lines=[cst.EmptyLine()])  # a blank line after the imports
    return module.with_changes(body=body[:after] + new_lines + body[after:])


def dotted_imports(stmt) -> set[str]:
    """The modules a ``try:`` block's body imports (its handlers' fallbacks are the same modules)."""
    import libcst as cst

    out: set[str] = set()
    for small in (s for line in stmt.body.body if isinstance(line, cst.SimpleStatementLine) for s in line.body):
        if isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
            out.update(a.name.value for a in small.names if isinstance(a.name, cst.Name))
        elif isinstance(small, cst.Import):
            out.update(cst.Module(body=[]).code_for_node(a.name) for a in small.names)
    return out
