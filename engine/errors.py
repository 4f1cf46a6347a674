"""Typed exceptions raised by the engine.

The CLI turns each into one line on stderr and an exit code; the server into the wire format's error
object. Every exception carries a message meant for a user, never a traceback.
"""


class GoinferError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(GoinferError):
    """A model file could not be read: missing, not GGUF, truncated, inconsistent."""


class UnsupportedModel(ModelLoadError):
    """The file is valid but asks for something we do not implement (architecture, tensor type)."""


class ModelNotFound(ModelLoadError):
    """A model reference names neither a file nor a built-in model."""


class FetchError(GoinferError):
    """Downloading or verifying a model failed."""


class TemplateError(GoinferError):
    """A chat template failed to render (or raised on purpose through raise_exception)."""


class ContextOverflow(GoinferError):
    """A prompt plus the requested output does not fit the context window."""


class InvalidRequest(GoinferError):
    """A generation request carries an invalid parameter."""


class RequestError(InvalidRequest):
    """A wire-format request body is invalid or asks for something we cannot do.

    `param` names the offending field as the client wrote it (`messages[0].content[1]`, `tools`, `n`);
    `code` is the machine-readable reason OpenAI-style errors carry (`invalid_value`, `unsupported_parameter`...).
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


class Cancelled(GoinferError):
    """A request was stopped on purpose (Ctrl-C, a client gone) before it finished."""


class BatchFileError(GoinferError):
    """A batch input or output file cannot be used: missing, unreadable, duplicate custom_id, unwritable."""
