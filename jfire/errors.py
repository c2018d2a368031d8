"""The one exception type users see: its message is printed as a single line, no traceback."""


class JfireError(Exception):
    """A problem with the user's input or environment, stated as what is wrong and what would be right."""


class TokenizerError(JfireError, ValueError):
    """A tokenizer that cannot be built or used as asked."""
