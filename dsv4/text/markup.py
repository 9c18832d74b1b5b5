"""The special strings of the DSV4 chat format (DSV4_FACTS section 6), shared by the encoder
(`dsv4.text.chat`) and the completion parser (`dsv4.text.chat_parse`).

Role and sentence markers are single tokens of the released tokenizer; DSML markup is ordinary
text around the special piece `｜DSML｜`. Bars are full-width (U+FF5C), `▁` is U+2581.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

TOOL_CALLS_TAG = f"<{DSML}tool_calls"  # the opening tag, without its ">"
TOOL_CALLS_START = f"\n\n{TOOL_CALLS_TAG}"  # content ends where this begins
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"


def to_json(value: Any) -> str:
    """JSON the way the format writes it everywhere: `json.dumps` defaults, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)
