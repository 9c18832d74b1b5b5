"""The server talks to the engine through its public API only, and its HTTP errors come from the
engine errors' types and fields, not from their wording."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import dsv4.serve
from conftest import parity_config, random_model
from dsv4.engine.core import Engine
from dsv4.engine.runner import Runner
from dsv4.errors import ContextOverflowError, RequestError
from dsv4.serve.errors import APIError
from dsv4.serve.serving_common import check_request

SERVE = Path(dsv4.serve.__file__).parent
# the engine's internals the server used to reach into; any of these on any object in dsv4/serve
# is a failure (the server has no other objects with these names)
INTERNAL = {"scheduler", "tracks", "_inflight", "runner"}


def _attributes(source: str) -> set[str]:
    return {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}


def test_the_scan_sees_what_it_looks_for():
    # the scan flags the accesses the server used to make, and sees the server's engine calls
    assert _attributes("self.engine.scheduler.check(x)\nself.engine._inflight.clear()") >= {"scheduler", "_inflight"}
    used = _attributes((SERVE / "async_engine.py").read_text())
    assert {"check", "add_request", "abort", "step", "fail_all", "stats", "vocab_size", "max_num_seqs"} <= used
    # the names are really the engine's internals (a renamed one must be renamed here too)
    engine = Engine(Runner(random_model(parity_config(), seed=1), max_num_seqs=1, max_model_len=32), None, eos_id=1)
    assert all(hasattr(engine, name) for name in INTERNAL)


def test_the_server_uses_only_the_engine_api():
    files = sorted(SERVE.rglob("*.py"))
    assert SERVE / "async_engine.py" in files and len(files) > 5
    found = {f"{f.relative_to(SERVE)}: .{name}" for f in files for name in _attributes(f.read_text()) & INTERNAL}
    assert not found, f"dsv4/serve reaches into the engine: {sorted(found)}"


def _refused(error: Exception, what: str = "prompt") -> APIError:
    ctx = SimpleNamespace(engine=SimpleNamespace(check=lambda ids, params: (_ for _ in ()).throw(error)))
    with pytest.raises(APIError) as e:
        check_request(ctx, [1, 2], None, what)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("error, what, param, code", [
    # the code and param come from the error, whatever its words
    (ContextOverflowError("needs 70 positions, has 64", param="max_tokens"), "prompt", "max_tokens",
     "context_length_exceeded"),
    (ContextOverflowError("needs 70 positions, has 64"), "prompt[1]", "prompt", "context_length_exceeded"),
    (ContextOverflowError("needs 70 positions, has 64"), "messages", "messages", "context_length_exceeded"),
    (RequestError("max_tokens and max_model_len are fine; the prompt is empty"), "prompt", "prompt", None),
])
def test_request_errors_map_by_type_not_text(error, what, param, code):
    err = _refused(error, what)
    assert (err.param, err.code) == (param, code)
    assert str(error) in err.message
