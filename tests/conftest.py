"""Test-wide setup: 8 simulated CPU devices, configured before any jax backend starts."""

import os

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


def pytest_addoption(parser):
    parser.addoption("--regen-golden", action="store_true", default=False,
                     help="rewrite tests/golden/<model>/<mesh>.json from the current planner")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the long equivalence matrix; CI runs it as a second step "
                                       "(`pytest -m slow`), the default run skips it")


def pytest_runtest_logreport(report):
    """With AUTOSHARD_TEST_TIMES=<file>: each test's phase seconds appended as it finishes (a partial run's
    times survive, unlike --durations), to keep the default suite within its time budget."""
    path = os.environ.get("AUTOSHARD_TEST_TIMES")
    if path:
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f}\t{report.when}\t{report.nodeid}\n")
