"""switchyard.integrations: patches that put switchyard into host frameworks, over the public API.

    from switchyard.integrations import hf         # Hugging Face transformers MoE models
    from switchyard.integrations import megatron   # Megatron-Core
    from switchyard.integrations import trl        # TRL's GRPOTrainer (needs trl)
    from switchyard.integrations import verl       # verl's engine plugins (needs verl)

Each integration imports its framework lazily (the framework is an optional dependency), checks its
version when it patches, reports what it patched, and can be removed again; what they share
(version rules, the patch lifecycle, the trainer phase) is ``_adapter``, the replay protocol is
``switchyard.replay``.
"""
__all__ = ["hf", "megatron", "trl", "verl"]
