"""Runs verl's real FSDP engine on the CPU, in this one process, for switchyard's verl tests and
examples/verl_r3.py. Each shim says why verl needs it here; none changes verl's source, and none
touches a path the tests check (the engine's model inputs, forward, log-probs, loss, backward).

Call ``setup()`` BEFORE importing verl: it sets the environment verl reads at import time, then
imports verl with the CPU platform (verl_cpu_platform) and ``external_modules`` loaded."""
import contextlib
import os
import socket

import torch


def setup(external_modules=()):
    # verl resolves its platform once, from VERL_PLATFORM or by probing CUDA / NPU / ROCm; there is
    # no CPU platform in verl 0.9.1, so verl_cpu_platform registers one.
    os.environ["VERL_PLATFORM"] = "cpu"
    # EngineRegistry only has FSDP engines for device "cuda" / "npu"; the lookup honours
    # VERL_ENGINE_DEVICE, so the CUDA entries (plain and vendor) are the ones the tests get.
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")
    _stub_cpu_memory_metrics()
    # verl resolves its platform when its engine module is imported, and switchyard's plugin
    # imports that module: the CPU platform must be registered first. verl imports the modules of
    # VERL_USE_EXTERNAL_MODULES in order while it is imported, before its entry-point plugins.
    mods = ["verl_cpu_platform"] + [m for m in external_modules if m]
    os.environ["VERL_USE_EXTERNAL_MODULES"] = ",".join(mods)
    import verl  # noqa: F401
    _unpinned_cpu_offload()
    init_process_group()


def _stub_cpu_memory_metrics():
    # verl calls get_torch_device().memory_allocated() / max_memory_allocated() / mem_get_info()
    # in its logging helpers (log_gpu_memory_usage, TrainingWorker metrics); torch.cpu has none.
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                 "max_memory_reserved"):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda *a, **k: 0)
    if not hasattr(torch.cpu, "mem_get_info"):
        torch.cpu.mem_get_info = lambda *a, **k: (0, 0)
    if not hasattr(torch.cpu, "reset_peak_memory_stats"):
        torch.cpu.reset_peak_memory_stats = lambda *a, **k: None
    if not hasattr(torch.cpu, "empty_cache"):
        torch.cpu.empty_cache = lambda *a, **k: None


def _unpinned_cpu_offload():
    # A forward-only engine (the reference policy) is built with FSDP2's
    # CPUOffloadPolicy(pin_memory=True); pinned host memory needs a CUDA driver. The same policy,
    # unpinned, is what a CPU-only process can hold.
    import verl.workers.engine.fsdp.transformer_impl as ti
    if getattr(ti.CPUOffloadPolicy, "_unpinned", False):
        return
    policy = ti.CPUOffloadPolicy

    def unpinned(pin_memory=True):
        return policy(pin_memory=False)
    unpinned._unpinned = True
    ti.CPUOffloadPolicy = unpinned


def init_process_group():
    # The FSDP engine calls torch.distributed.get_rank() and builds a device mesh: a gloo group of
    # the processes torchrun (or python/tests_verl/verl_ranks.py) started, from RANK / WORLD_SIZE /
    # MASTER_ADDR / MASTER_PORT, or else a one-process group (what torchrun / Ray would set up on a
    # real cluster).
    import torch.distributed as dist
    if dist.is_initialized():
        return
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("WORLD_SIZE", "1")
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def tiny_qwen3_moe(path, seed=0, num_hidden_layers=2, **overrides):
    """Saves a tiny random Qwen3-MoE (8 experts, top-2, vocab 97; ``overrides`` replace any of
    these config fields, e.g. bench/py_verl_overhead.py's larger sizes) and a tokenizer-free
    config at ``path``; returns the path (verl's HFModelConfig loads models from a path)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    fields = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=97, max_position_embeddings=128,
        head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        initializer_range=0.2)  # large enough that the routes chosen change the log-probs
    fields.update(overrides)
    cfg = AutoConfig.for_model("qwen3_moe", **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(path))
    return str(path)


@contextlib.contextmanager
def env(**variables):
    """Sets environment variables (None: unset) for the block and restores the previous values:
    verl reads VERL_ENGINE_VENDOR and the plugin its SWITCHYARD_VERL_* variables when an engine is
    made."""
    old = {k: os.environ.get(k) for k in variables}
    def put(values):
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    put(variables)
    try:
        yield
    finally:
        put(old)


def engine(model_path, *, use_remove_padding=True, micro_batch_size=2, lr=1e-2, forward_only=False,
           router_replay_mode=None, gradient_checkpointing=True, ulysses_sequence_parallel_size=1,
           pad_to_length_bucket=None):
    """verl's language-model engine for ``model_path``, chosen by verl's EngineRegistry (so by
    VERL_ENGINE_VENDOR), built and initialised: fsdp2, fp32, sdpa attention; over every process
    of the group, data parallel (world / ulysses_sequence_parallel_size) x Ulysses SP.
    ``pad_to_length_bucket``: verl's static padding of a packed micro-batch up to a multiple of
    it (engine config pad_to_length), or None (off)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(
        path=model_path, use_remove_padding=use_remove_padding, load_tokenizer=False,
        # verl's default attention is flash_attention_2 (CUDA only); sdpa runs on the CPU.
        override_config={"attn_implementation": "sdpa"},
        enable_gradient_checkpointing=gradient_checkpointing)
    kw = {}
    if pad_to_length_bucket is not None:
        kw.update(pad_to_length=True, pad_to_length_bucket=int(pad_to_length_bucket))
    if router_replay_mode is not None:
        from verl.workers.config import EngineRouterReplayConfig
        kw["router_replay"] = EngineRouterReplayConfig(mode=router_replay_mode)
    engine_config = FSDPEngineConfig(
        # FSDP1 refuses CPU parameters; fsdp2 (fully_shard) shards them on a gloo mesh.
        strategy="fsdp2", model_dtype="fp32", forward_only=forward_only,
        # fp32 end to end (verl defaults to bf16 params under autocast): the tests compare with a
        # plain fp32 transformers forward.
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch_size,
        infer_micro_batch_size_per_gpu=micro_batch_size, use_torch_compile=False,
        use_remove_padding=use_remove_padding,
        ulysses_sequence_parallel_size=ulysses_sequence_parallel_size, **kw)
    optim_config = FSDPOptimizerConfig(lr=lr, lr_warmup_steps=0, total_training_steps=10,
                                       weight_decay=0.0, clip_grad=1e9)
    eng = EngineRegistry.new(model_type="language_model", backend="fsdp2",
                             model_config=model_config, engine_config=engine_config,
                             optimizer_config=optim_config, checkpoint_config=CheckpointConfig())
    eng.initialize()
    return eng



def megatron_engine(path, *, ep=1, tp=1, num_layers=2, hidden=32, vocab=128, num_experts=8,
                    top_k=2, holder=None, monkeypatch=None):
    """SwitchyardMegatronEngine from verl's registry (R3, padded layout) with a Megatron-Core GPT
    MoE model built here in place of initialize() (which needs Megatron-Bridge), expert parallel
    ``ep`` and tensor parallel ``tp`` (sequence parallel when tp > 1) over the process group.
    Shims, each needed on the CPU only: the schedule's token counter is allocated on "cuda"; the
    model turns verl's [B, S] padding mask (read by TE's attention) into the [B, 1, S, S] mask
    Megatron-Core's local attention takes; a tokenizer-less config gets the pad id verl reads from
    a tokenizer. ``monkeypatch`` (pytest's): the shims and VERL_ENGINE_VENDOR undone after the
    test; None: set for the process. ``holder``: receives the engine as "eng" before the model
    is built (whose build may fail). Returns (engine, {router key: its last routing map}, model).
    """
    import sys
    import types

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import megatron_shims  # (python/tests)
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (EngineRouterReplayConfig, HFModelConfig, McoreEngineConfig,
                                     McoreOptimizerConfig)
    from verl.workers.engine import EngineRegistry

    import switchyard.integrations.megatron as sym

    class _CpuTorch:  # Megatron's schedule allocates its token counter on "cuda"
        def __getattr__(self, name):
            return getattr(torch, name)

        def zeros(self, *a, **k):
            if k.get("device") == "cuda":
                k["device"] = "cpu"
            return torch.zeros(*a, **k)
    if monkeypatch is None:
        schedules.torch = _CpuTorch()
        os.environ["VERL_ENGINE_VENDOR"] = "switchyard"
    else:
        monkeypatch.setattr(schedules, "torch", _CpuTorch())
        monkeypatch.setenv("VERL_ENGINE_VENDOR", "switchyard")
    megatron_shims.install()

    class CpuGPT(GPTModel):  # verl's [B, S] padding mask -> local attention's [B, 1, S, S]
        def forward(self, input_ids, position_ids, attention_mask, **kw):
            S = attention_mask.shape[1]
            causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
            mask = causal[None, None] | ~attention_mask[:, None, None, :].bool()
            return super().forward(input_ids, position_ids, mask, **kw)

    mc = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=False)
    eng = EngineRegistry.new(
        model_type="language_model", backend="megatron", model_config=mc,
        engine_config=McoreEngineConfig(strategy="megatron", use_remove_padding=False,
                                        expert_model_parallel_size=ep,
                                        tensor_model_parallel_size=tp,
                                        router_replay=EngineRouterReplayConfig(mode="R3")),
        optimizer_config=McoreOptimizerConfig(lr=1e-2), checkpoint_config=CheckpointConfig())
    object.__setattr__(mc, "tokenizer", types.SimpleNamespace(pad_token_id=0))
    if holder is not None:
        holder["eng"] = eng
    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
        kv_channels=8, ffn_hidden_size=64, moe_ffn_hidden_size=16, num_moe_experts=num_experts,
        moe_router_topk=top_k,
        moe_token_dispatcher_type="alltoall", add_bias_linear=False, use_cpu_initialization=True,
        moe_permute_fusion=False, params_dtype=torch.float32, moe_router_dtype="fp32",
        moe_aux_loss_coeff=0.0, normalization="RMSNorm", gated_linear_unit=True,
        qk_layernorm=True, init_method_std=0.2, expert_model_parallel_size=ep,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    torch.manual_seed(0)
    model = CpuGPT(cfg, get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                 qk_layernorm=True),
                   vocab_size=vocab, max_sequence_length=128, position_embedding_type="rope")
    model.eval()
    eng.tf_config, eng.module, eng.is_value_model = cfg, [model], False
    eng.router_replays = sym.attach_replay(eng.module, invalid_replay_rows="merge")
    maps = {}
    for r in sym.replays(eng.module):
        router = next(m for m in model.modules() if getattr(m, "_sy", None) is not None and
                      m._sy.key == r)
        router.register_forward_hook(lambda m, a, out, r=r: maps.__setitem__(r, out[1].clone()))
    return eng, maps, model


def batch(prompts, responses, *, num_hidden_layers, top_k, routed_experts=None, pad_id=0,
          micro_batch_size=2, use_remove_padding=True, temperature=1.0, **non_tensor):
    """A verl batch as the PPO trainer hands it to the engine: DataProto's layout (left-padded
    prompts | right-padded responses, attention_mask, response_mask, position_ids and, when given,
    ``routed_experts`` int16 [B, S, num_hidden_layers, K] over those positions) converted by verl's
    own ``left_right_2_no_padding`` to the jagged layout, plus the keys TrainingWorker sets."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    B = len(prompts)
    P = max(len(p) for p in prompts)
    R = max(len(r) for r in responses)
    input_ids = torch.full((B, P + R), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[b, P - len(p):P] = torch.tensor(p)
        input_ids[b, P:P + len(r)] = torch.tensor(r)
        attention_mask[b, P - len(p):P + len(r)] = 1
        response_mask[b, :len(r)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    fields = dict(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                  position_ids=position_ids, responses=input_ids[:, P:])
    if routed_experts is not None:
        fields["routed_experts"] = routed_experts
    td = TensorDict(fields, batch_size=[B])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, use_remove_padding=use_remove_padding, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=micro_batch_size, use_fused_kernels=False,
                         temperature=temperature, pad_token_id=pad_id, global_batch_size=B,
                         **non_tensor)
    return td, dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    prompt_len=P)
