#!/usr/bin/env bash
# Set up (editable install with test extras), lint (ruff), and run the whole test suite.
# pytest exit code 5 ("no tests collected") is an error here: a suite that runs nothing must not pass.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
python -m ruff check .
python -m pytest -q "$@"
