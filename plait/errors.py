"""The one exception type for mistakes a user can fix.

Anything raised as a `UserError` is printed by the CLI as a single line and ends the process with
exit code 2, no traceback. Everything else is a bug in plait and keeps its traceback.
"""


class UserError(Exception):
    """A bad input: the message names the field, the value and the fix, on one line."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))  # one line, whatever the caller wrote
        # every process of a torchrun/srun job meets it alike (it comes from the command and its
        # files, not from this process's node or device): only the first says it
        self.same_everywhere = False

    def everywhere(self) -> "UserError":
        self.same_everywhere = True
        return self


def bad_value(field: str, value, fix: str) -> UserError:
    """Build the standard one-line error: `field = value: fix`."""
    return UserError(f"{field} = {value!r}: {fix}")
