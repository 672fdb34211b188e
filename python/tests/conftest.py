# Shared fixtures: a seeded generator that says how to reproduce a failure.
import os

import pytest
import torch


@pytest.fixture
def gen(request):
    seed = int(os.environ.get("SY_TEST_SEED", "1234"))
    g = torch.Generator().manual_seed(seed)
    request.node.user_properties.append(("reproduce", f"SY_TEST_SEED={seed}"))
    return g


def pytest_configure(config):
    torch.set_num_threads(1)
