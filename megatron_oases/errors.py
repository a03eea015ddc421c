"""One exception type for bad user input: the CLI prints its message as one line and exits 2."""


class OasesConfigError(ValueError):
    """A configuration the user can fix; the message names the fix."""
