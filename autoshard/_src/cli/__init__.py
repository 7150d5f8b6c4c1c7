"""The `autoshard` command line: see `app` (flags, dispatch, errors) and the command modules.

Ctrl-C while the command imports jax and the planners (the first second): one line and exit 130, no
traceback. The handler goes in first (the package above loads nothing heavy), only when this process
is the command (`autoshard ...` or `python -m autoshard`), not when a program or test imports `main`;
`app.exit_on_interrupt` takes over for the command itself."""

import os as _os
import signal as _signal
import sys as _sys


def _leave(*_: object) -> None:
    argv = _sys.argv[1:]
    command = argv[0] if argv and not argv[0].startswith("-") else "run"     # as app._with_command reads it
    _os.write(2, f"autoshard {command}: interrupted\n".encode())
    _os._exit(130)


def _is_the_command() -> bool:
    path = _sys.argv[0] if _sys.argv else ""
    name, parent = _os.path.basename(path), _os.path.basename(_os.path.dirname(path))
    return name == "autoshard" or (name == "__main__.py" and parent == "autoshard")


if _is_the_command() and _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
    _signal.signal(_signal.SIGINT, _leave)

from .app import build_parser as build_parser  # noqa: E402  (after the handler: this import is the slow part)
from .app import main as main  # noqa: E402
