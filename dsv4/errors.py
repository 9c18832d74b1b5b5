"""The project's own error classes: what a user can cause and fix.

Every error a user can provoke with ordinary input (a bad flag, a corrupt checkpoint, a config
that contradicts its tensors, a request the engine cannot serve) is a :class:`Dsv4Error` whose
message names the culprit: the file, tensor, field, flag or argument. The ``dsv4`` command prints
these on one line and exits with status 2; anything else is a bug and keeps its traceback.

Errors that live next to the code that raises them also derive from :class:`Dsv4Error`:
``ConfigError`` (:mod:`dsv4.config`), ``CheckpointError`` (:mod:`dsv4.weights.loader`),
``WeightFormatError`` (:mod:`dsv4.weights.formats`), ``QuantizeError``
(:mod:`dsv4.weights.quantize`) and ``TokenizerError`` (:mod:`dsv4.text.tokenizer`). Most are also
``ValueError`` so that ``except ValueError`` keeps working.
"""

from __future__ import annotations

__all__ = ["Dsv4Error", "UsageError", "DeviceError", "RequestError", "ContextOverflowError"]


class Dsv4Error(Exception):
    """Base of every error the user can fix; the message names what is wrong."""


class UsageError(Dsv4Error, ValueError):
    """A bad argument, flag value or environment setting (``DSV4_CACHE``, ``--max-model-len``...)."""


class DeviceError(Dsv4Error, RuntimeError):
    """A device was asked for that this machine does not have (``--device cuda`` without a GPU)."""


class RequestError(Dsv4Error, ValueError):
    """A request the engine refuses: bad sampling parameters, an empty or unencodable prompt,
    token ids outside the vocabulary.

    ``param`` names the request field at fault when it is not the prompt (``"max_tokens"``); the
    server reports it as the OpenAI error's ``param``. ``code`` is the OpenAI error code, if any."""

    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextOverflowError(RequestError):
    """A request needs more positions than the state was sized for (``max_model_len``)."""

    code = "context_length_exceeded"
