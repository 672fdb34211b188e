"""R3 on verl's FSDP engine: the rollout's MoE routes replayed in verl's log-prob and update passes.

What a verl user adds (on every verl process, Ray workers included):

    VERL_ENGINE_VENDOR=switchyard

switchyard pip-installed: verl loads the plugin through the `verl.plugins` entry point switchyard
declares; otherwise also VERL_USE_EXTERNAL_MODULES=switchyard.integrations.verl. The rollout must
return the routes (vLLM / SGLang: actor_rollout_ref.rollout.enable_rollout_routing_replay=True).
R2 instead: SWITCHYARD_VERL_ROUTER_REPLAY=R2. See docs/guides/verl.md.

This script runs on the CPU (CI runs it): verl 0.9.1 has no CPU platform, so it uses the test
shims of python/tests_verl/verl_cpu.py (drop them on GPUs), and the rollout is transformers'
generate() with switchyard's route capture standing in for vLLM's routed_experts.

    PYTHONPATH=build/python $(bash scripts/env.sh verl)/bin/python examples/verl_r3.py
"""
import os
import sys
import tempfile

os.environ["VERL_ENGINE_VENDOR"] = "switchyard"  # <- the line that turns R3 on

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "tests_verl"))
import verl_cpu  # noqa: E402  (CPU shims; not needed on GPUs)

verl_cpu.setup(external_modules=["switchyard.integrations.verl"])

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import switchyard.integrations.hf as syhf  # noqa: E402

torch.manual_seed(0)
path = verl_cpu.tiny_qwen3_moe(tempfile.mkdtemp())
prompts = [[5, 6, 7], [8, 9], [11, 12, 13, 14], [15, 16]]
new_tokens = 6

# ---- rollout: sample, keep the routes of every token and the sampler's log-probs ----
policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
P = max(len(p) for p in prompts)
ids = torch.zeros(len(prompts), P, dtype=torch.long)
mask = torch.zeros_like(ids)
for b, p in enumerate(prompts):
    ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
with syhf.patch(policy, router_dtype=None) as p, p.capture() as cap:
    gen = policy.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    seq_mask = torch.cat([mask, torch.ones(len(prompts), new_tokens, dtype=torch.long)], 1)
    routed = cap.to_verl(seq_mask)  # verl's routed_experts: int16 [B, S, num_hidden_layers, K]
responses = gen.sequences[:, P:]
rollout_lp = torch.stack([torch.log_softmax(l.float(), -1) for l in gen.logits], 1)
rollout_lp = rollout_lp.gather(-1, responses[..., None])[..., 0]  # [B, new_tokens]

# ---- the trainer: verl's engine, picked by VERL_ENGINE_VENDOR ----
engine = verl_cpu.engine(path)
print(f"engine: {type(engine).__name__}, router replay {engine.router_replay_mode}")
td, _ = verl_cpu.batch(prompts, responses.tolist(), routed_experts=routed,
                       num_hidden_layers=routed.shape[2], top_k=routed.shape[3])
with engine.eval_mode(), engine.router_patch.capture() as used:
    out = engine.infer_batch(td)  # old log-probs: the rollout's routes replayed
trainer_lp = torch.stack([t[len(p) - 1:-1] for t, p in
                          zip(out["model_output"]["log_probs"].unbind(), prompts)])
diff = (trainer_lp - rollout_lp).abs().max().item()

# Router mismatch against the rollout, at every response token the trainer routed.
u = used.ids()[0]  # [1, T, L, K] packed forwards, concatenated
off = td["input_ids"].offsets()
mismatch = total = 0
for b, p in enumerate(prompts):
    seq = u[off[b]:off[b + 1]]
    want = routed[b][seq_mask[b].bool()]
    r = slice(len(p), seq.shape[0] - 1)  # response tokens but the last (never routed)
    mismatch += int((seq[r].sort(-1).values != want[r].sort(-1).values.to(seq.dtype)).any(-1).sum())
    total += seq[r].shape[0] * seq.shape[1]
m = out["metrics"]
print(f"log-prob pass: {int(m['router_replay/replayed_rows'].aggregate())} rows replayed, "
      f"{int(m['router_replay/native_rows'].aggregate())} native (last tokens); router mismatch vs "
      f"rollout {mismatch} of {total}; max |trainer - rollout log-prob| {diff:.2e}")
assert mismatch == 0


def pg_loss(model_output, data, dp_group=None):  # a stand-in for verl's ppo_loss
    return -model_output["log_probs"].values().mean(), {}


with engine.train_mode():
    upd = engine.train_batch(td, loss_function=pg_loss)
m = upd["metrics"]
print(f"update: {int(m['router_replay/replayed_rows'].aggregate())} rows replayed, "
      f"grad_norm {float(m['grad_norm']):.3f}")
