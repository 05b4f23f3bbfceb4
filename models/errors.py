"""The one exception type for errors a user can cause.

Its message is one clear sentence meant for the user; the CLI prints it and exits non-zero, the server turns it
into an OpenAI-shaped error. Anything else that escapes is a bug in kiln.
"""


class KilnError(Exception):
    """A problem with the user's input (a path, a file, a flag, a request), described in one sentence."""
