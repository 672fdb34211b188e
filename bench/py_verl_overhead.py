"""Overhead of switchyard.integrations.verl on verl's FSDP engine: the same trainer step (the
old-log-prob pass, infer_batch, then the update, train_batch: forward, loss, backward with verl's
default activation checkpointing, optimizer) on the same micro-batches carrying the rollout's
routed_experts, with verl's own FSDPEngineWithLMHead ("verl", native routing: routed_experts
unused); switchyard's SwitchyardFSDPEngine with R3 ("R3": both passes replay routed_experts);
and with SWITCHYARD_VERL_ROUTER_DTYPE=float32 too ("fp32+R3").
Every engine is built first; then the steps interleave, one step of each variant per round in a
shuffled order (bench_machine.interleaved_rounds), in one process on the CPU, verl's real engine
(fsdp2, one gloo process) through the CPU shims of python/tests_verl/verl_cpu.py; prints the CPU
model, each variant's median step (thread CPU time, one thread, and wall) and the median over
rounds of its CPU time / verl's in the same round (1.00 = no overhead), with the interquartile
range.

    VV=$(bash scripts/env.sh verl)
    PYTHONPATH=build/python $VV/bin/python bench/py_verl_overhead.py [--quick] [--threads N]
        [--hidden 128] [--layers 4] [--experts 16] [--batch 8] [--prompt 8] [--response 24]
        [--steps 40] [--routes random|own]

A tiny Qwen3-MoE (no download) in fp32 (verl_cpu's engine: fp32 parameters and compute) where the
routers are a large share of the work, so the ratio is an upper bound of the overhead on real
model sizes. The model is fp32 already, so "fp32+R3" differs from "R3" by the gate GEMM alone (no
cast): on CPU tensors the fp32 router runs switchyard's batch-invariant gate kernel
(switchyard.torch.router_gating_linear) where "R3" keeps the model's own torch GEMM.
"""
import gc
import os
import sys
import tempfile
import warnings

_threads = next((a.split("=", 1)[1] if "=" in a else sys.argv[i + 2]
                 for i, a in enumerate(sys.argv[1:]) if a.startswith("--threads")), "1")
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "python", "tests_verl"))

import verl_cpu  # noqa: E402  (the verl tests' CPU shims, engine and batch builders)

verl_cpu.setup(external_modules=["switchyard.integrations.verl"])  # before verl is imported

import torch  # noqa: E402
import verl  # noqa: E402

from bench_machine import (interleaved_rounds, machine_line, print_paired_ratios,  # noqa: E402
                           trainer_step_args, trainer_step_parser)

VARIANTS = {  # name: (VERL_ENGINE_VENDOR, SWITCHYARD_VERL_ROUTER_REPLAY, ..._ROUTER_DTYPE)
    "verl": (None, None, None),
    "R3": ("switchyard", "R3", None),
    "fp32+R3": ("switchyard", "R3", "float32"),
}
_ENV = ("VERL_ENGINE_VENDOR", "SWITCHYARD_VERL_ROUTER_REPLAY", "SWITCHYARD_VERL_ROUTER_DTYPE")


def make_engine(variant, model_path, a):
    """An initialised engine from verl's EngineRegistry for ``variant`` (construction not timed)."""
    with verl_cpu.env(**dict(zip(_ENV, VARIANTS[variant]))):
        torch.manual_seed(0)
        eng = verl_cpu.engine(model_path, micro_batch_size=a.micro, lr=1e-4)
    want = "FSDPEngineWithLMHead" if variant == "verl" else "SwitchyardFSDPEngine"
    assert type(eng).__name__ == want, (variant, type(eng).__name__)
    return eng


def own_routes(model_path, dense):
    """verl's routed_experts [B, S, layers, 2] int16 of the model's own routing of the padded batch
    ``dense`` (a transformers forward of the checkpoint, switchyard's capture; zeros at padding
    and at each sequence's last token): what a rollout engine routing like the trainer returns."""
    import switchyard.integrations.hf as syhf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="sdpa",
                                                 dtype=torch.float32)
    with syhf.patch(model, router_dtype=None) as p, torch.no_grad(), p.capture() as cap:
        model(input_ids=dense["input_ids"], attention_mask=dense["attention_mask"],
              position_ids=dense["position_ids"], use_cache=False)
    return cap.to_verl(dense["attention_mask"])


def make_batches(a, model_path=None):
    """(log-prob batch, update batch): ``a.batch`` sequences of ``a.prompt`` (varied) prompt and
    ``a.response`` (varied) response tokens, with routed_experts as the rollout reports them
    (ids at every real token but each sequence's last, zeros elsewhere): random distinct ids
    (``a.routes`` "random"), or the model's own routing of the batch ("own", ``own_routes``)."""
    g = torch.Generator().manual_seed(0)
    def seqs(longest):  # a.batch sequences of longest // 2 .. longest random tokens
        lens = torch.randint(longest // 2, longest + 1, (a.batch,), generator=g).tolist()
        return [torch.randint(3, 97, (n,), generator=g).tolist() for n in lens]
    prompts, responses = seqs(a.prompt), seqs(a.response)
    kw = dict(num_hidden_layers=a.layers, top_k=2, micro_batch_size=a.micro)
    _, dense = verl_cpu.batch(prompts, responses, **kw)
    m = dense["attention_mask"].bool()
    B, S = m.shape
    ids = torch.rand(B * S * a.layers, a.experts, generator=g).argsort(-1)[:, :2]
    routed = ids.view(B, S, a.layers, 2).to(torch.int16)
    last = m.long().cumsum(1).eq(m.sum(1, keepdim=True)) & m
    routed[~m | last] = 0
    if getattr(a, "routes", "random") == "own":
        routed = own_routes(model_path, dense)
    infer, _ = verl_cpu.batch(prompts, responses, routed_experts=routed, **kw)
    update, _ = verl_cpu.batch(prompts, responses, routed_experts=routed,
                               return_model_output=True, **kw)
    return infer, update, int((m & ~last).sum()) * a.layers


def _loss(model_output, data, dp_group=None):
    return -model_output["log_probs"].values().mean(), {}


def step(eng, infer, update):
    """One trainer step of the actor: the old-log-prob pass, then the update."""
    with eng.eval_mode():
        old = eng.infer_batch(infer)
    with eng.train_mode():
        upd = eng.train_batch(update, loss_function=_loss)
    return old, upd


def run(eng, variant, infer, update, routed_rows):
    """One trainer step, checked: under R3 every routed row of both passes replayed the
    rollout's ids."""
    old, upd = step(eng, infer, update)
    if variant != "verl":
        for out in (old, upd):
            assert out["metrics"]["router_replay/replayed_rows"].aggregate() == routed_rows


def main():
    ap = trainer_step_parser(micro=4, prompt=8, response=24, steps=40)
    ap.add_argument("--routes", choices=["random", "own"], default="random",
                    help="the rollout's routed_experts: random distinct ids (default), or the "
                         "model's own routing of the batch (a rollout that routes like the "
                         "trainer: the experts' load is the baseline's)")
    a = trainer_step_args(ap)
    if a.quick:
        a.steps = 8
    torch.set_num_threads(int(a.threads))
    print(machine_line())
    print(f"verl {verl.__version__} FSDP engine (fsdp2, 1 gloo process); Qwen3-MoE hidden "
          f"{a.hidden}, {a.layers} layers, {a.experts} experts top-2, fp32; batch {a.batch} "
          f"(micro {a.micro}), prompts <= {a.prompt}, responses <= {a.response} tokens; step = "
          f"log-prob pass + update; {a.steps} steps each, interleaved, {a.threads} thread(s); "
          f"{a.routes} routes")
    tmp = tempfile.TemporaryDirectory()  # kept until the end: verl holds the model's path
    path = verl_cpu.tiny_qwen3_moe(
        tmp.name, num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        head_dim=a.hidden // 4, num_experts=a.experts, moe_intermediate_size=a.hidden // 2,
        initializer_range=0.02)
    engines = {v: make_engine(v, path, a) for v in VARIANTS}
    infer, update, routed_rows = make_batches(a, path)
    variants = list(VARIANTS)
    for v in variants:  # warm-up: first-call costs of each engine
        run(engines[v], v, infer, update, routed_rows)
    gc.collect()  # what exists now is out of the cyclic GC's generations (as in py_trl_overhead)
    gc.freeze()
    times = interleaved_rounds(variants, a.steps,
                               lambda v: run(engines[v], v, infer, update, routed_rows))
    print_paired_ratios(times, "verl", skip=0)
    tmp.cleanup()


if __name__ == "__main__":
    main()
