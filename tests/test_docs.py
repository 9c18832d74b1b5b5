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
