"""A tiny transformers Qwen3-MoE, a word-level tokenizer and a prompt dataset for running TRL's
GRPOTrainer on the CPU in seconds (no download)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" warning

import torch  # noqa: E402

VOCAB = 97


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab.update({f"t{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<pad>")


def model(seed=0, **overrides):
    """A seeded tiny Qwen3-MoE causal LM (2 MoE layers, 8 experts, top-2), fp32, eager attention."""
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    args = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, head_dim=8,
                pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                norm_topk_prob=True)
    args.update(overrides)
    cfg = AutoConfig.for_model("qwen3_moe", **args)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg)


def dense_model(seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model("qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                               head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cfg._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(cfg)


def dataset(n=8, seed=0):
    """Prompts of different lengths (2..6 words), so that left padding matters."""
    from datasets import Dataset
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        k = 2 + i % 5
        prompts.append(" ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB, (k,), generator=g)))
    return Dataset.from_dict({"prompt": prompts})


def reward_len(completions, **kwargs):
    """A verifiable toy reward: shorter completions score higher (varies across a group)."""
    return [-float(len(c.split())) for c in completions]


def config(tmp_path, **overrides):
    from trl import GRPOConfig
    args = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                num_generations=4, max_completion_length=6, max_steps=2, learning_rate=1e-2,
                logging_steps=1, report_to=[], save_strategy="no", seed=0,
                dataloader_num_workers=0, temperature=1.0, disable_tqdm=True)
    args.update(overrides)
    return GRPOConfig(**args)
