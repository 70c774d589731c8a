"""The one exception type for bad user input; the CLI turns it into a one-line message and exit 2."""


class UserInputError(Exception):
    """A problem with a config, data file or checkpoint that the user can fix.

    The message is complete on its own: it names the file, line or config key and what was expected.
    Several problems found together are joined by newlines, one per line.
    """
