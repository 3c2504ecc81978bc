"""User-facing errors: every CLI turns a `JaxinferError` into one line on stderr and exit code 2, and Ctrl-C into one
line and exit code 130."""

import functools
import os
import signal
import sys
import threading

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


def how_it_ended(returncode: int) -> str:
    """A failed child process's end, for an error line: "exited with status 1", or for one a signal ended "was killed
    by SIGILL (Illegal instruction)" (subprocess gives -signal: a peer built for instructions this CPU lacks)."""
    if returncode < 0:
        try:
            ended_by = signal.Signals(-returncode)
        except ValueError:
            return f"was killed by signal {-returncode}"
        return f"was killed by {ended_by.name} ({signal.strsignal(ended_by)})"
    return f"exited with status {returncode}"


# Python runs a signal handler between two bytecodes of the main thread, wherever they are: also inside a garbage
# collector callback or a __del__ method, where the KeyboardInterrupt it raises is printed as "Exception ignored" and
# dropped (JAX's _xla_gc_callback is one), and inside C++ extension code that wraps it in another exception (JAX's
# pytree comparisons). So a Ctrl-C is raised again every REINTERRUPT_S seconds until something takes it: long enough
# for the interrupted frames to unwind and clean up first.
REINTERRUPT_S = 1.0
_unanswered = threading.Event()


def _raise_interrupt(signum, frame):
    _unanswered.set()
    signal.setitimer(signal.ITIMER_REAL, REINTERRUPT_S)  # SIGALRM: _raise_again
    raise KeyboardInterrupt


def _raise_again(signum, frame):
    if _unanswered.is_set():
        _raise_interrupt(signum, frame)


def interrupt_taken():
    """Called where a KeyboardInterrupt is caught and handled: stop raising it again."""
    _unanswered.clear()
    signal.setitimer(signal.ITIMER_REAL, 0)


def is_interrupt(e: BaseException) -> bool:
    """Whether `e` is a KeyboardInterrupt or was raised because of one (an exit is an exit)."""
    if isinstance(e, SystemExit):
        return False
    while e is not None:
        if isinstance(e, KeyboardInterrupt):
            return True
        e = e.__cause__ or e.__context__
    return False


def exit_on_error(main):
    """Wrap a CLI `main` so that a JaxinferError prints `error: ...` and exits with status 2, and Ctrl-C
    (KeyboardInterrupt) prints INTERRUPTED_LINE and exits with status INTERRUPTED, without a traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        # Only where Python's own handler would raise the KeyboardInterrupt: a process started with SIGINT ignored
        # (a shell's background job) keeps ignoring it, and handlers can only be set in the main thread.
        ours = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if ours:
            previous = signal.signal(signal.SIGINT, _raise_interrupt), signal.signal(signal.SIGALRM, _raise_again)
        try:
            return main(*args, **kwargs)
        except JaxinferError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except BaseException as e:
            if not is_interrupt(e):
                raise
        finally:
            if ours:
                interrupt_taken()
                signal.signal(signal.SIGINT, previous[0])
                signal.signal(signal.SIGALRM, previous[1])
        # Printed once the interrupted frames are gone: a progress bar iterating in one of them closes its line as it
        # is collected, so the message starts a line of its own.
        print(INTERRUPTED_LINE, file=sys.stderr)
        sys.exit(INTERRUPTED)

    return wrapper
