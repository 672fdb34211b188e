"""One vocabulary: the Python API uses the engine's (DeepEP's and Megatron-Core's) names.

Names that earlier switchyard releases used are kept only to say what replaced them: passing an old
keyword or reading an old attribute raises an error that names the new one, instead of a bare
"unexpected keyword argument" (or, worse, a silent default)."""

RENAMED = {
    "topk": "top_k",
    "probs": "topk_weights",
    "recv_probs": "recv_topk_weights",
    "apply_probs": "apply_weights",
    "tokens_per_expert": "num_tokens_per_expert",
    # removed in 0.3.0 (docs/deprecations.md)
    "replay_backward": "recompute",
    "num_pending_backward": "num_pending_recompute",
    "repeated_ids": "invalid_replay_rows",
}


def renamed_error(op, old, kind="keyword argument"):
    new = RENAMED[old]
    return f"[{op}] {kind} '{old}' was renamed '{new}' (switchyard uses the engine's names)"


def check_kwargs(op, kwargs):
    """Raise TypeError for any old keyword name in kwargs, naming its replacement."""
    for old in kwargs:
        if old in RENAMED:
            raise TypeError(renamed_error(op, old))


def old_attribute(obj, name):
    """AttributeError for a missing attribute, naming the replacement when it is an old name."""
    op = type(obj).__name__
    if name in RENAMED:
        return AttributeError(renamed_error(op, name, "attribute"))
    return AttributeError(f"'{op}' object has no attribute '{name}'")
