"""The `autoshard` command line: see `app` (flags, dispatch, errors) and the command modules."""

from .app import build_parser as build_parser
from .app import main as main
