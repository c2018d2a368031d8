"""The one exception type users see: its message is printed as a single line, no traceback."""


class JfireError(Exception):
    """A problem with the user's input or environment, stated as what is wrong and what would be right."""


class TokenizerError(JfireError, ValueError):
    """A tokenizer that cannot be built or used as asked."""


class RequestError(JfireError, ValueError):
    """A request that can never run as sent: `param` names the request field it is about
    (OpenAI's "param": "prompt", "max_tokens", "stop", ...), `code` a machine-readable reason
    ("context_length_exceeded", "invalid_value") or None."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(JfireError):
    """The waiting queue is at its bound; retry later."""


class EngineStopped(JfireError):
    """The engine failed and serves nothing more (a server answers 503 and exits non-zero, so
    a supervisor restarts it)."""
