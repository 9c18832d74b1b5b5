"""dsv4: a fast, standalone inference engine for DeepSeek-V4 checkpoints."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # The Python API is imported lazily so `import dsv4` stays cheap for the CLI and tools.
    if name in ("LLM", "SamplingParams", "EngineConfig"):
        from .engine import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
