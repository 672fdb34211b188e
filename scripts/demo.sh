#!/usr/bin/env bash
# The main job: installs what is missing (Debian packages, the project's Python venv), builds the
# Python module and runs `python -m switchyard.demo` (a multi-step GRPO run with TRL's GRPOTrainer on a
# small Qwen3-MoE in each router mode: bf16, fp32, R3, R2; options are passed through, see --help).
# Output: switchyard-demo/ (report.md, summary.json, curves.png, the cached checkpoint). Exit code 0
# only if R3's router mismatch against the rollout is exactly 0 on every step. The C++ engine's own
# quick check is `./build/tools/switchyard quickcheck`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/deps.sh
venv=$(bash scripts/env.sh)
SWITCHYARD_VENV="$venv" bash scripts/build.sh _switchyard
export HF_HUB_OFFLINE=1
# --engine vllm: the rollouts come from a real vLLM in its own venv (made here once, reused).
prev=""
for a in "$@"; do
  if [ "$a" = "--engine=vllm" ] || { [ "$prev" = "--engine" ] && [ "$a" = "vllm" ]; }; then
    SWITCHYARD_VLLM_PYTHON="$(bash scripts/env.sh vllm)/bin/python"
    export SWITCHYARD_VLLM_PYTHON
  fi
  prev=$a
done
PYTHONPATH="$root/build/python${PYTHONPATH:+:$PYTHONPATH}" exec "$venv/bin/python" -m switchyard.demo "$@"
