"""The model shapes of tests/common/model_shapes.h, for the Python side-by-side benchmarks.

The C++ header is the one place the numbers live (with the published configs they come from);
this module reads its ``inline constexpr MoeModel kName{.field = value, ...};`` blocks so that a
Python bench and a C++ bench cannot disagree on what "DeepSeek-V3" means.

    from model_shapes import MODELS
    q = MODELS["qwen3_30b_a3b"]; q.hidden, q.num_experts, q.top_k
"""
from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

HEADER = pathlib.Path(__file__).resolve().parent.parent / "tests" / "common" / "model_shapes.h"


@dataclass(frozen=True)
class MoeModel:
    """One MoE layer's shapes and router semantics (field names as in the header)."""

    name: str
    hidden: int
    moe_ffn_hidden: int
    num_experts: int
    top_k: int
    score_function: str
    num_groups: int
    group_topk: int
    expert_bias: bool
    topk_scaling_factor: float
    num_shared_experts: int
    shared_expert_ffn_hidden: int
    num_layers: int
    num_moe_layers: int
    aux_loss_type: str
    aux_loss_coeff: float

    def router_options(self) -> dict:
        """Keyword arguments of switchyard.RouterConfig for this model's selection (no losses)."""
        opts = dict(num_experts=self.num_experts, top_k=self.top_k,
                    score_function=self.score_function)
        if self.num_groups:
            opts.update(num_groups=self.num_groups, group_topk=self.group_topk)
        if self.topk_scaling_factor != 1.0:
            opts.update(topk_scaling_factor=self.topk_scaling_factor)
        return opts


def _value(text: str, kind: type):
    text = text.strip()
    if kind is str:
        m = re.fullmatch(r'"([^"]*)"|\w+::(\w+)', text)
        if not m:
            raise ValueError(f"model_shapes.h: cannot read {text!r} as a name")
        return m.group(1) if m.group(1) is not None else m.group(2)
    if kind is bool:
        if text not in ("true", "false"):
            raise ValueError(f"model_shapes.h: cannot read {text!r} as a bool")
        return text == "true"
    return kind(text.replace("'", ""))


def _kind(field) -> type:
    return {"str": str, "int": int, "bool": bool, "float": float}[field.type]


def load(header: pathlib.Path = HEADER) -> dict[str, MoeModel]:
    """Every MoeModel of the header, by its name field: the fields its block sets, the rest from
    the struct's default member initialisers. Raises ValueError on a field it cannot read or one
    that has neither."""
    src = header.read_text()
    fields = MoeModel.__dataclass_fields__
    struct = re.search(r"struct MoeModel \{(.*?)\n\};", src, re.S)
    if not struct:
        raise ValueError(f"model_shapes.h: no struct MoeModel in {header}")
    defaults = {m.group(1): _value(m.group(2), _kind(fields[m.group(1)]))
                for m in re.finditer(r"^\s*[\w:]+\s+(\w+)\s*=\s*([^;]+);", struct.group(1), re.M)
                if m.group(1) in fields}
    models = {}
    for block in re.finditer(r"inline constexpr MoeModel (\w+)\{(.*?)\};", src, re.S):
        values = dict(defaults)
        for m in re.finditer(r"\.(\w+)\s*=\s*([^,]+),", block.group(2)):
            key, text = m.group(1), m.group(2)
            if key not in fields:
                raise ValueError(f"model_shapes.h: {block.group(1)} has unknown field {key}")
            values[key] = _value(text, _kind(fields[key]))
        missing = set(fields) - set(values)
        if missing:
            raise ValueError(f"model_shapes.h: {block.group(1)} misses {sorted(missing)}")
        model = MoeModel(**values)
        models[model.name] = model
    if not models:
        raise ValueError(f"model_shapes.h: no MoeModel found in {header}")
    return models


MODELS = load()
QWEN3_30B_A3B = MODELS["qwen3_30b_a3b"]
DEEPSEEK_V3 = MODELS["deepseek_v3"]
MIXTRAL_8X7B = MODELS["mixtral_8x7b"]
