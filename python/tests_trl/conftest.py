# The TRL integration's tests (their own ctest entry, python_trl): the shared fixtures and the
# `hostile` marker of python/tests/conftest.py, loaded from there so both folders use one copy.
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
globals().update({k: v for k, v in runpy.run_path(os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "conftest.py")).items()
    if not k.startswith("__")})
