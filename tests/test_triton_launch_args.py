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
                if kw.arg is None and isinstance(kw.value, ast.Name):
                    keys = _dict_keys(func, kw.value.id)
                    assert keys is not None, f"{path.name}:{call.lineno}: cannot resolve **{kw.value.id}"
                    names |= keys
            unknown = names - params[f.value.id] - LAUNCH_OPTIONS
            if unknown:
                bad.append(f"{path.name}:{call.lineno} {f.value.id}: {sorted(unknown)}")
    assert not bad, "launch keywords the kernel does not declare: " + "; ".join(bad)
