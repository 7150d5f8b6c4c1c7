"""Test-wide setup: 8 simulated CPU devices, configured before any jax backend starts."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


def pytest_addoption(parser):
    parser.addoption("--regen-golden", action="store_true", default=False,
                     help="rewrite tests/golden/<model>/<mesh>.json from the current planner")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the long equivalence matrix; CI runs it as a second step "
                                       "(`pytest -m slow`), the default run skips it")
