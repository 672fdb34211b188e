"""TRL's GRPOTrainer with switchyard: FP32 router and R3 (the rollout's routes replayed in every
log-prob forward) on a tiny Qwen3-MoE, on the CPU, in seconds. docs/guides/trl.md explains it; the
test suite runs this file (python/tests_trl/test_trl_example.py). No download."""
import os
import sys
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from switchyard.integrations.trl import GRPOTrainer  # noqa: E402  (instead of trl's)

# A tiny Qwen3-MoE and a word-level tokenizer "t3 t4 ... t96", built here (no download).
torch.manual_seed(0)
vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{f"t{i}": i for i in range(3, 97)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                    bos_token="<bos>", unk_token="<pad>")
config = AutoConfig.for_model("qwen3_moe", hidden_size=32, intermediate_size=64,
                              moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, num_experts=8,
                              num_experts_per_tok=2, vocab_size=97, pad_token_id=0, eos_token_id=1)
model = AutoModelForCausalLM.from_config(config)

dataset = Dataset.from_dict({"prompt": ["t5 t6", "t7 t8 t9", "t10", "t11 t12 t13 t14"] * 4})


def reward_short(completions, **kwargs):  # shorter completions score higher
    return [-float(len(c.split())) for c in completions]


steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
with tempfile.TemporaryDirectory() as out:
    args = GRPOConfig(output_dir=out, use_cpu=True, bf16=False, max_steps=steps,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      num_iterations=2,           # two updates per generation: old log-probs too
                      learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no",
                      disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_short, args=args,
                          train_dataset=dataset, processing_class=tokenizer,
                          router_dtype=torch.float32,  # switchyard: FP32 router
                          replay="R3")                 # switchyard: replay the rollout's routes
    trainer.train()

print(trainer.switchyard_patch)
for h in trainer.state.log_history:  # TRL's logs, with switchyard's metrics among them
    if "switchyard/policy/router_mismatch" in h:
        gen = (f"reward {h['reward']:+.2f}, old-pass mismatch "
               f"{h['switchyard/old/router_mismatch']:.3f}, " if "reward" in h else "")
        print(f"step {h['step']}: {gen}policy mismatch {h['switchyard/policy/router_mismatch']:.3f}"
              f", replayed rows {h['switchyard/policy/replayed_rows']:.0f}")
# The experts received the rollout's ids in every forward (router_mismatch above is what the
# routers would have chosen themselves: the mismatch R3 removes, large once the policy moved).
worst = max(r["used_mismatch_rows"] for r in trainer.switchyard_records)
print(f"R3: largest mismatch between the experts used and the rollout's routes over "
      f"{len(trainer.switchyard_records)} forwards: {worst} rows")
sys.exit(1 if worst else 0)
