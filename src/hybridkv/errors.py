"""The one base class for errors a user can fix (bad input, a target that cannot be met).

Every component derives its specific errors from `UserError`; the CLI prints them as one line and exits 2,
the gRPC server maps them to INVALID_ARGUMENT and the operator to a condition with a reason.
"""


class UserError(ValueError):
    """Bad input or an impossible request, with a message that says what to fix."""


# What an error message quotes of a user's input at most: a reason must fit gRPC's metadata and a log line.
EXCERPT_CHARS = 80


def excerpt(value, limit: int = EXCERPT_CHARS) -> str:
    """`repr(value)`, cut to `limit` characters with the full length said, for quoting input in an error message."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"
