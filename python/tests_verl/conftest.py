# The verl integration's tests run in the verl side environment (scripts/env.sh verl) against the
# real verl package on the CPU; verl_cpu.setup() installs the CPU shims before verl is imported.
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import verl_cpu  # noqa: E402

# switchyard.integrations.verl through VERL_USE_EXTERNAL_MODULES: what a user does when switchyard
# is on PYTHONPATH rather than pip-installed (test_verl_loads_the_plugin_through_the_entry_point_
# switchyard_declares covers the entry point of an installed switchyard).
verl_cpu.setup(external_modules=["switchyard.integrations.verl"])


def pytest_configure(config):
    # Same marker as python/tests/conftest.py (its README table is generated from python/tests).
    config.addinivalue_line(
        "markers", "hostile(tried, gets): a careless or hostile use and what switchyard does with "
        "it")
