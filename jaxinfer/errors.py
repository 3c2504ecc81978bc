"""User-facing errors: every CLI turns a `JaxinferError` into one line on stderr and exit code 2."""

import functools
import sys


class JaxinferError(Exception):
    """Bad input from the user (file, flag, prompt): reported as one line, never as a traceback."""


def exit_on_error(main):
    """Wrap a CLI `main` so that a JaxinferError prints `error: ...` and exits with status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except JaxinferError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    return wrapper
