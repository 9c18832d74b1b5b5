"""The README stands alone (issue 8, item 11): no pointers outside the repository, every flag of
the model-running commands documented, the architecture page present."""

from __future__ import annotations

import re
from pathlib import Path

from dsv4.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_readme_links_stay_inside_the_repository():
    readme = (ROOT / "README.md").read_text()
    assert "../" not in readme
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    assert "docs/ARCHITECTURE.md" in readme and (ROOT / "docs" / "ARCHITECTURE.md").is_file()


def test_every_generate_chat_and_serve_flag_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for command in ("generate", "chat", "serve"):
        for action in sub.choices[command]._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    assert flag in readme, (command, flag)


def _signature_text(name: str, params) -> str:
    """``name(a=1, *, b="x")`` as the README writes it (double quotes, [] for empty-list factories)."""
    import inspect
    import json
    parts = []
    for p in params:
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is inspect.Parameter.KEYWORD_ONLY and "*" not in parts:
            parts.append("*")
        default = p.default
        parts.append(f"{p.name}={json.dumps(default) if isinstance(default, str) else repr(default)}")
    return f"{name}({', '.join(parts)})"


def test_readme_shows_the_whole_llm_and_sampling_params_signatures():
    """Issue 21, item 9: the README's constructors missed load_mtp, progress, max_num_batched_tokens,
    warm_up, prompt_logprobs; they must list every parameter with its true default."""
    import dataclasses
    import inspect

    from dsv4.engine.config import EngineConfig
    from dsv4.engine.llm import LLM
    from dsv4.engine.sampling import SamplingParams

    readme = " ".join((ROOT / "README.md").read_text().split())
    llm = list(inspect.signature(LLM.__init__).parameters.values())[1:]
    assert _signature_text("LLM", llm) in readme, _signature_text("LLM", llm)
    for cls in (SamplingParams, EngineConfig):
        fields = [inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=f.default if f.default is not dataclasses.MISSING else f.default_factory())
                  for f in dataclasses.fields(cls)]
        assert _signature_text(cls.__name__, fields) in readme, _signature_text(cls.__name__, fields)
