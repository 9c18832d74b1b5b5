"""Every Triton launch passes only keywords its kernel declares.

Triton's interpreter (the CPU tests) accepts a keyword the kernel does not have; the compiler on a
GPU raises ``KeyError: Keyword argument X was specified but unrecognised``. This reads the kernel
modules' source, so the mismatch fails here, on any machine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dsv4.ops.triton as kernels

LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg"}
MODULES = sorted(Path(kernels.__file__).parent.glob("*.py"))


def _dict_keys(func: ast.FunctionDef, name: str) -> set[str] | None:
    """Keys of ``name = dict(k=...)`` assigned in ``func`` (a launch's ``**name``)."""
    for node in ast.walk(func):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id == name and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "dict"):
            return {kw.arg for kw in node.value.keywords if kw.arg}
    return None


def _function(tree: ast.Module, name: str, here: Path) -> ast.FunctionDef | None:
    """``name``'s definition in the module, or in the sibling module it is imported from."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
        if isinstance(node, ast.ImportFrom) and node.level == 1 and any(a.name == name for a in node.names):
            other = ast.parse((here.parent / f"{node.module}.py").read_text())
            return _function(other, name, here)
    return None


def _returned_dict_keys(tree: ast.Module, func: ast.FunctionDef, name: str, here: Path) -> set[str] | None:
    """``a, name, b = helper(...)`` in ``func``: the keys of the dict ``helper`` returns there."""
    for node in ast.walk(func):
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)):
            continue
        names = [e.id if isinstance(e, ast.Name) else None for e in node.targets[0].elts]
        helper = _function(tree, node.value.func.id, here) if name in names else None
        for ret in (n for n in ast.walk(helper) if isinstance(n, ast.Return)) if helper else ():
            if isinstance(ret.value, ast.Tuple) and isinstance(ret.value.elts[names.index(name)], ast.Name):
                return _dict_keys(helper, ret.value.elts[names.index(name)].id)
    return None


def _splat_keys(tree: ast.Module, func: ast.FunctionDef, value: ast.expr, where: str, here: Path) -> set[str]:
    """The keywords a launch's ``**value`` passes: ``**name`` with ``name = dict(...)`` in the
    launching function, or unpacked from what a plan helper returns; a parameter ``consts2`` (a
    second operand set) is its module's ``consts``; ``**{k + "2": v for k, v in name.items()}`` the
    same keys suffixed."""
    suffix = ""
    if isinstance(value, ast.DictComp) and isinstance(value.key, ast.BinOp) and \
            isinstance(value.key.right, ast.Constant) and isinstance(value.generators[0].iter, ast.Call):
        suffix, value = value.key.right.value, value.generators[0].iter.func.value
    assert isinstance(value, ast.Name), f"{where}: cannot resolve **{ast.unparse(value)}"
    keys = _dict_keys(func, value.id) or _returned_dict_keys(tree, func, value.id, here)
    if keys is None and value.id in {a.arg for a in func.args.args}:
        base = value.id.rstrip("0123456789")
        found = [k for f in tree.body if isinstance(f, ast.FunctionDef) for k in [_dict_keys(f, base)] if k]
        keys = set().union(*found) if found else None
    assert keys is not None, f"{where}: cannot resolve **{value.id}"
    return {k + suffix for k in keys}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_launch_keywords_are_kernel_parameters(path):
    tree = ast.parse(path.read_text())
    params = {n.name: {a.arg for a in n.args.args} for n in tree.body if isinstance(n, ast.FunctionDef)}
    bad = []
    for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for call in (n for n in ast.walk(func) if isinstance(n, ast.Call)):
            f = call.func
            if not (isinstance(f, ast.Subscript) and isinstance(f.value, ast.Name) and f.value.id in params):
                continue
            names = {kw.arg for kw in call.keywords if kw.arg}
            for kw in call.keywords:
                if kw.arg is None:
                    names |= _splat_keys(tree, func, kw.value, f"{path.name}:{call.lineno}", path)
            unknown = names - params[f.value.id] - LAUNCH_OPTIONS
            if unknown:
                bad.append(f"{path.name}:{call.lineno} {f.value.id}: {sorted(unknown)}")
    assert not bad, "launch keywords the kernel does not declare: " + "; ".join(bad)


def _is_jit(func: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in func.decorator_list)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_kernels_read_only_constexpr_globals(path):
    """A ``@triton.jit`` function may read a module global only if it is a ``tl.constexpr`` (or a
    function / module): the GPU compiler raises ``NameError: Cannot access global variable`` for a
    plain number, which Triton's interpreter (the CPU tests) accepts."""
    import importlib

    import triton.language as tl
    module = importlib.import_module(f"dsv4.ops.triton.{path.stem}")
    tree = ast.parse(path.read_text())
    bad = []
    for func in (n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_jit(n)):
        local = {a.arg for a in func.args.args}
        local |= {t.id for n in ast.walk(func) if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For))
                  for t in ast.walk(n.targets[0] if isinstance(n, ast.Assign) else n.target) if isinstance(t, ast.Name)}
        for node in ast.walk(func):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                value = getattr(module, node.id, None)
                if isinstance(value, (int, float)) and not isinstance(value, tl.constexpr):
                    bad.append(f"{path.name}:{node.lineno} {func.name} reads the global {node.id} = {value!r}")
    assert not bad, "\n".join(bad)
