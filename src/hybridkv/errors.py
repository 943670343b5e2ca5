"""The one base class for errors a user can fix (bad input, a target that cannot be met).

Every component derives its specific errors from `UserError`; the CLI prints them as one line and exits 2,
the gRPC server maps them to INVALID_ARGUMENT and the operator to a condition with a reason.
"""


class UserError(ValueError):
    """Bad input or an impossible request, with a message that says what to fix."""
