"""Text side of dsv4: tokenizer loading, streaming detokenization and the DSV4 chat encoding."""

from dsv4.text.chat import ChatFormatError, encode_messages
from dsv4.text.chat_parse import (
    ContentDelta,
    Event,
    ParseError,
    ParsedCompletion,
    ReasoningDelta,
    StreamingParser,
    ToolCall,
    ToolCallEvent,
    parse_completion,
)
from dsv4.text.tiny_tokenizer import build_tiny_tokenizer, write_tiny_tokenizer
from dsv4.text.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "ChatFormatError",
    "ContentDelta",
    "Event",
    "IncrementalDetokenizer",
    "ParseError",
    "ParsedCompletion",
    "ReasoningDelta",
    "StreamingParser",
    "ToolCall",
    "ToolCallEvent",
    "Tokenizer",
    "build_tiny_tokenizer",
    "encode_messages",
    "parse_completion",
    "write_tiny_tokenizer",
]
