"""switchyard.integrations: patches that put switchyard into host frameworks, over the public API.

    from switchyard.integrations import hf         # Hugging Face transformers MoE models
    from switchyard.integrations import megatron   # Megatron-Core

Each integration imports its framework lazily (the framework is an optional dependency), checks its
version when it patches, reports what it patched, and can be removed again.
"""
__all__ = ["hf", "megatron"]
