"""User-facing errors: every CLI turns a `JaxinferError` into one line on stderr and exit code 2, and Ctrl-C into one
line and exit code 130."""

import functools
import os
import sys

INTERRUPTED = 130  # the status of a process ended by Ctrl-C (128 + SIGINT), as shells report it
INTERRUPTED_LINE = "interrupted (Ctrl-C)"


class JaxinferError(Exception):
    """Bad input from the user (file, flag, prompt): reported as one line, never as a traceback."""


def not_a_model_file(path: str) -> JaxinferError:
    """The error for a model path that is not a regular file: missing, a directory (a model's folder given for the
    file in it), or something else (a FIFO, a device)."""
    if os.path.isdir(path):
        return JaxinferError(f"{path} is a directory, not a model file: give the path of a .gguf file")
    if os.path.exists(path):
        return JaxinferError(f"{path} is not a regular file")
    return JaxinferError(f"model file not found: {path}")


def exit_on_error(main):
    """Wrap a CLI `main` so that a JaxinferError prints `error: ...` and exits with status 2, and Ctrl-C
    (KeyboardInterrupt) prints INTERRUPTED_LINE and exits with status INTERRUPTED, without a traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except JaxinferError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            pass
        # Printed once the interrupted frames are gone: a progress bar iterating in one of them closes its line as it
        # is collected, so the message starts a line of its own.
        print(INTERRUPTED_LINE, file=sys.stderr)
        sys.exit(INTERRUPTED)

    return wrapper
