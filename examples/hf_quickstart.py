"""switchyard with a Hugging Face transformers MoE model: FP32 router, R2, capture during
generate(), R3 from the captured routes, checkpointing. The Hugging Face guide's example
(docs/guides/hf.md) is this file; the test suite runs it (test_hf_replay.py). A tiny Qwen3-MoE
from a config: no download."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import switchyard.integrations.hf as syhf  # noqa: E402

torch.manual_seed(0)
config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64,
                              moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, num_experts=8,
                              num_experts_per_tok=2, vocab_size=97, pad_token_id=0)
model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)

patch = syhf.patch(model, router_dtype=torch.float32)  # every MoE router of the model, in place
print(patch)

input_ids = torch.randint(3, 97, (2, 12))
attention_mask = torch.ones_like(input_ids)
attention_mask[1, :3] = 0                              # left padding

# R2: record in the old-log-prob pass, replay in the update (weights from the live fp32 logits).
patch.set_action("record")
with torch.no_grad():
    model(input_ids, attention_mask=attention_mask)
patch.set_action("replay_forward")
model.train()
model(input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()
print(patch.counts())                   # {layer: {num_replayed_rows, num_native_rows, ...}}
assert all(c["num_replayed_rows"] == input_ids.numel() for c in patch.counts().values())

# Capture during generate(): the prefill and every decode step with the KV cache.
model.eval()
patch.set_action(None)
with patch.capture() as cap:
    seq = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6,
                         min_new_tokens=6, do_sample=False, pad_token_id=0)
full_mask = torch.cat([attention_mask, torch.ones(2, 6, dtype=attention_mask.dtype)], dim=1)
arrays = cap.routed_experts(full_mask)                 # vLLM's routed_experts, one per sequence
assert [tuple(a.shape) for a in arrays] == [(17, 2, 2), (14, 2, 2)]

# R3: replay the rollout's routes in a training forward (activation checkpointing on).
targets, report = patch.targets_from_vllm(arrays, full_mask)  # [B, S, moe_layers, K], -1 = native
model.train()
model.activation_checkpointing_enable()               # 5.x name of gradient_checkpointing_enable
patch.reset_counts()
patch.set_targets(targets)
model(seq, attention_mask=full_mask, labels=seq).loss.backward()
for layer, c in patch.counts().items():                # padding and last tokens route natively
    assert c["num_replayed_rows"] == 17 + 14 and c["num_recomputed_rows"] == seq.numel(), c
model.activation_checkpointing_disable()

patch.unpatch()
print("hf quickstart ok:", patch.family, "layers", patch.layers)
