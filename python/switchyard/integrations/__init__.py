"""switchyard.integrations: patches that put switchyard's fixes into training frameworks in place.

Each module imports its framework lazily and is optional: ``switchyard.integrations.megatron``
(Megatron-Core), ``switchyard.integrations.hf`` (transformers).
"""
