"""One rank of test_trl_ranks.py's runs: switchyard's TRL GRPOTrainer under DDP at 2 ranks on the
CPU (gloo), launched as a user launches it:

    python -m torch.distributed.run --standalone --nproc_per_node 2 trl_ranks_worker.py OUT

Each rank trains the tiny Qwen3-MoE of trl_models through these runs, one after the other in the
same process group, and writes what it saw to OUT/rank{RANK}.json:

* ``fsdp``: replay="R3" on TRL's own generate() with ``fsdp="full_shard"`` asked for: accelerate
  1.15 does not run FSDP on the CPU and trains with DDP instead (recorded: distributed type, model
  wrapper), first, so that the run meets a fresh accelerate state as a user's script does;
* ``r3``: replay="R3", routes from a rollout_func (synthetic routes, far from the model's own
  choice, so only a replay puts them in the experts), num_iterations=2 (old and policy forwards);
* ``none``: the same with replay=None (the mismatch is measured, nothing replayed);
* ``generate``: replay="R3" on TRL's own generate() (routes captured in generation);
* ``disagree``: rank 1's model routes to 3 experts instead of 2: the ranks disagree on the routes'
  layout, which must raise the same ValueError on both ranks (recorded) instead of hanging;
* ``unrouted``: replay=None, rank 1's rollout engine returns no routes (rank 0's does): raised on
  both ranks the same way.

The observer is independent of switchyard's counters: a forward pre-hook on the model reads each
forward's tokens (a log-prob forward carries ``labels``, a generation forward does not), a forward
pre-hook on each MoE layer's ``experts`` module reads the expert ids it receives, and the routes
each token should get come from the test's own rollout_func or from the ids the experts received in
generation (the fsdp and generate runs). Per log-prob forward it counts the routed rows (real
tokens but each sequence's last, per MoE layer), the rows whose received ids differ from the
rollout's, and every row the experts received (padding too).
"""
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

T0 = time.monotonic()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import trl_models as tm  # noqa: E402
import switchyard.integrations.trl as sytrl  # noqa: E402

E = 8  # the tiny model's experts
RUNS = ["fsdp", "r3", "none", "generate", "disagree", "unrouted"]


def route(tok, j, layer):
    """The rollout_func's synthetic route of token ``tok`` at place ``j`` of its sequence (two
    distinct experts; test_trl.py's)."""
    e0 = (tok * 7 + j * 3 + layer) % E
    return [e0, (e0 + 1 + tok % (E - 1)) % E]


class Observer:
    """Expert ids each log-prob forward gave the experts, against the rollout's routes."""

    def __init__(self, model):
        self.trainer = None
        self.expected = {}   # tuple(real tokens of a sequence) -> routes [n - 1, L, K]
        self.forwards = []   # one dict per log-prob forward
        self.generated = []  # (fed real tokens, ids [T, L, K]) per generated row
        self.seqs = set()    # the sequences this rank trained on
        self._cur = None     # (input_ids, attention_mask) of the running log-prob forward
        self._gen = None     # the running generation: tokens, last mask, ids per layer
        model.register_forward_pre_hook(self._model_hook, with_kwargs=True)
        # after the forward: gradient checkpointing's recomputation in the backward is not a
        # forward of its own
        model.register_forward_hook(lambda *a: setattr(self, "_cur", None))
        self.layers = [i for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "experts")]
        for i in self.layers:
            model.model.layers[i].mlp.experts.register_forward_pre_hook(
                lambda mod, args, i=i: self._experts_hook(i, args[1]))

    # ---- generation: the ids the experts received are the rollout's routes -----------------
    def _end_generation(self):
        g, self._gen = self._gen, None
        if g is None:
            return
        tokens = torch.cat(g["tokens"], 1)
        mask = g["mask"][:, :tokens.shape[1]].bool()
        ids = torch.stack([torch.cat(g["ids"][i], 1) for i in self.layers], 2)  # [B, T, L, K]
        for b in range(tokens.shape[0]):
            self.generated.append((tokens[b][mask[b]].tolist(), ids[b][mask[b]]))

    def _routes_of(self, seq):
        """The rollout's routes [len(seq) - 1, L, K] of a trained sequence: the rollout_func's,
        or those of the first generated row whose fed tokens start with all but its last token
        (the last token is never fed)."""
        if seq in self.expected:
            return self.expected[seq]
        n = len(seq) - 1
        for real, r in self.generated:
            if len(real) >= n and real[:n] == list(seq[:n]):
                return r[:n]
        raise AssertionError(f"observer: no rollout row holds {seq}")

    def _model_hook(self, mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if "labels" in kwargs:  # a log-prob forward (TRL passes labels), never a generation step
            self._end_generation()
            self._cur = (ids.cpu(), mask.cpu())
            self.forwards.append(dict(step=int(self.trainer.state.global_step),
                                      grad=torch.is_grad_enabled(), mismatch=0, compared=0,
                                      rows=0))
            return
        self._cur = None
        if self._gen is None or ids.shape[1] > 1:  # a prefill: a new generate() call
            self._end_generation()
            self._gen = dict(tokens=[], mask=None, ids={i: [] for i in self.layers})
        self._gen["tokens"].append(ids.cpu())
        self._gen["mask"] = mask.cpu()

    def _experts_hook(self, layer, top_k_index):
        if self._cur is None:
            if self._gen is not None:
                B = self._gen["tokens"][-1].shape[0]
                self._gen["ids"][layer].append(
                    top_k_index.detach().cpu().reshape(B, -1, top_k_index.shape[-1]))
            return
        ids, mask = self._cur
        B, S = ids.shape
        got = top_k_index.detach().cpu().reshape(B, S, -1).sort(-1).values
        f = self.forwards[-1]
        f["rows"] += B * S
        li = self.layers.index(layer)
        for b in range(B):
            pos = mask[b].bool().nonzero().flatten()
            seq = tuple(ids[b, pos].tolist())
            self.seqs.add(seq)
            n = len(seq) - 1  # routed tokens: all but the last
            want = self._routes_of(seq)[:n, li].sort(-1).values
            f["mismatch"] += int((got[b, pos[:n]] != want).any(-1).sum())
            f["compared"] += n


def rollout_func_for(obs, tok, routes_field=True):
    """A rollout_func whose synthetic routes the observer also knows (its ``expected``); without
    ``routes_field`` its output carries no routes."""

    def rollout(prompts, trainer):
        p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        c_ids = [[3 + (sum(p) * 5 + 7 * i + k) % 90 for k in range(1 + (sum(p) + i) % 4)]
                 for i, p in enumerate(p_ids)]
        routes = []
        for p, c in zip(p_ids, c_ids):
            full = p + c
            r = torch.tensor([[route(full[j], j, l) for l in range(2)]
                              for j in range(len(full) - 1)], dtype=torch.int32)
            obs.expected[tuple(full)] = r
            routes.append(r)
        out = {"prompt_ids": p_ids, "completion_ids": c_ids,
               "logprobs": [[-1.0] * len(c) for c in c_ids]}
        if routes_field:
            out["routed_experts"] = routes
        return out
    return rollout


def run(name, out, rank):
    replay = None if name in ("none", "unrouted") else "R3"
    model = tm.model(num_experts_per_tok=3 if name == "disagree" and rank == 1 else 2)
    obs = Observer(model)
    tok = tm.tokenizer()
    kw = dict(rollout_func=rollout_func_for(obs, tok, not (name == "unrouted" and rank == 1))) \
        if name in ("r3", "none", "unrouted") else {}
    args = tm.config(out, per_device_train_batch_size=4, num_generations=2, max_steps=2,
                     num_iterations=2 if name in ("r3", "none") else 1,
                     **(dict(fsdp="full_shard") if name == "fsdp" else {}))
    tr = sytrl.GRPOTrainer(model=model, reward_funcs=tm.reward_len, args=args,
                           train_dataset=tm.dataset(16), processing_class=tok, replay=replay, **kw)
    obs.trainer = tr
    res = dict(distributed_type=str(tr.accelerator.distributed_type),
               num_processes=tr.accelerator.num_processes)
    try:
        tr.train()
    except ValueError as e:
        res["error"] = str(e)
    res.update(model_wrapper=type(tr.model_wrapped).__name__, records=tr.switchyard_records,
               observer=obs.forwards, seqs=sorted(list(s) for s in obs.seqs),
               log_history=[h for h in tr.state.log_history if "step" in h])
    return res


def main():
    out_dir = sys.argv[1]
    runs = sys.argv[2].split(",") if len(sys.argv) > 2 else RUNS
    # torchrun (and accelerate launch's torchrun path) sets RANK; accelerate's mpirun path sets
    # Open MPI's variable, RANK only once accelerate's state is made
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    result = dict(rank=rank, runs={})
    with tempfile.TemporaryDirectory() as tmp:
        for name in runs:
            print(f"[rank {rank}] {time.monotonic() - T0:.1f} s: run {name}", file=sys.stderr,
                  flush=True)
            try:
                result["runs"][name] = run(name, os.path.join(tmp, name), rank)
            except Exception:
                result["runs"][name] = dict(crash=traceback.format_exc())
                break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
