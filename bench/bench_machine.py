"""What the Python peer benchmarks print about the machine they ran on (one copy for all of them;
bench/bench_machine.h is the C++ side): the CPU model and the switchyard kernel ISA in use."""
import collections
import functools
import platform
import time


def cpu_model():
    """The "model name" line of /proc/cpuinfo (what lscpu prints), else the platform's guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_line():
    """One line for the top of every benchmark's output: CPU model, kernel ISA, torch version."""
    try:
        import switchyard as sy
        isa = sy.cpu_isa()
    except ImportError:  # a torch-only peer script run without PYTHONPATH=build/python
        isa = "n/a (switchyard not importable)"
    try:
        import torch
        peer = f"; torch {torch.__version__}"
    except ImportError:
        peer = ""
    return f"CPU: {cpu_model()}; kernel ISA {isa}{peer}"


def best_of_rotated_rounds(variants, rounds, run):
    """Runs every variant ``rounds`` times, rotating the order each round so that no variant always
    runs last (machine state, caches); ``run(variant)`` returns (wall, process CPU) seconds.
    Returns {variant: (best wall, best CPU)}."""
    best = {v: (float("inf"), float("inf")) for v in variants}
    for r in range(rounds):
        for v in variants[r % len(variants):] + variants[:r % len(variants)]:
            w, c = run(v)
            best[v] = (min(best[v][0], w), min(best[v][1], c))
    return best


def print_step_ratios(best, steps, peer):
    """The per-step table of best_of_rotated_rounds' result, each ratio against ``peer``."""
    bw, bc = best[peer]
    print("  variant    CPU ms/step  ratio   wall ms/step  ratio")
    for v, (w, c) in best.items():
        print(f"  {v:<8} {c / steps * 1e3:11.1f} {c / bc:6.2f} {w / steps * 1e3:14.1f} "
              f"{w / bw:6.2f}")


class PieceTimes:
    """The step-profile benches' counters (bench/py_trl_step_profile.py,
    bench/py_verl_step_profile.py): CPU time and calls of wrapped functions per step, the best
    round of each variant kept. ``clock``: the CPU-time clock (thread or process)."""

    TOTAL = "step (total)"

    def __init__(self, clock=time.thread_time):
        self.clock = clock
        self.acc = collections.defaultdict(float)
        self.cnt = collections.Counter()
        self.order = [self.TOTAL]  # the pieces as listed (callers before their callees)
        self.best = {}  # (variant, piece) -> (seconds, calls) of the variant's best round

    def wrap(self, owner, name, label):
        """Replaces ``owner.name`` (a class's own attribute, else a module's) with a counted call
        listed as ``label`` (about 1 us per call: pieces called thousands of times per step read
        a little high; nested pieces are included in their callers)."""
        own = owner.__dict__.get(name) if isinstance(owner, type) else None
        if isinstance(own, (staticmethod, classmethod)):
            own = None  # (wrapped as it is read: the function)
        orig = own if own is not None else getattr(owner, name)
        self.order.append(label)

        @functools.wraps(orig)
        def timed(*args, **kwargs):
            t = self.clock()
            try:
                return orig(*args, **kwargs)
            finally:
                self.acc[label] += self.clock() - t
                self.cnt[label] += 1
        setattr(owner, name, timed)

    def round(self, variant, steps, run):
        """Times ``run()`` (a round of ``steps`` steps of ``variant``, CPU time by ``clock``, or
        the seconds it returns) and keeps each piece's best round."""
        self.acc.clear()
        self.cnt.clear()
        t = self.clock()
        got = run()
        self.acc[self.TOTAL] = got if got is not None else self.clock() - t
        self.cnt[self.TOTAL] = steps
        for k, x in self.acc.items():
            if x < self.best.get((variant, k), (float("inf"),))[0]:
                self.best[(variant, k)] = (x, self.cnt[k])

    def print(self, variants, steps, how):
        """Per variant: ms per step and calls per step of every piece (``how``: the rounds)."""
        for v in variants:
            print(f"{v}: ms/step, calls/step (best of {how})")
            for k in self.order:
                if (v, k) in self.best:
                    x, n = self.best[(v, k)]
                    print(f"  {k:50s} {x / steps * 1e3:8.3f} {n / steps:7.1f}")


def trainer_step_parser(**defaults):
    """The options every trainer-overhead bench shares (tiny Qwen3-MoE shape, steps, rounds,
    threads, --quick); a bench adds its own to the returned parser. ``trainer_step_args`` parses."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller model, 2 rounds")
    ap.add_argument("--threads", default="1")
    for name, default in {"hidden": 128, "layers": 4, "experts": 16, "batch": 8, "steps": 4,
                          "rounds": 4, **defaults}.items():
        ap.add_argument(f"--{name}", type=int, default=default)
    return ap


def trainer_step_args(ap):
    """Parses ``ap`` (from trainer_step_parser); --quick shrinks the model and the run."""
    a = ap.parse_args()
    if a.quick:
        a.hidden, a.layers, a.steps, a.rounds = 64, 2, 2, 2
    return a


def trl_trainer_kwargs(a, out):
    """GRPOTrainer keyword arguments of the TRL overhead benches: the TRL tests' tiny Qwen3-MoE
    (python/tests_trl/trl_models.py, on sys.path) in ``a``'s shape (trainer_step_args), its
    tokenizer, dataset and length reward, num_iterations 2 (an old log-prob pass per step), output
    to ``out``. The caller seeds torch first."""
    import trl_models as tm
    model = tm.model(hidden_size=a.hidden, num_hidden_layers=a.layers, num_experts=a.experts,
                     moe_intermediate_size=a.hidden // 2, intermediate_size=2 * a.hidden,
                     head_dim=a.hidden // 4)
    args = tm.config(out, per_device_train_batch_size=a.batch, num_generations=a.batch // 2,
                     max_completion_length=a.completion, max_steps=a.steps, num_iterations=2,
                     logging_steps=10**6,
                     # every completion a.completion tokens long: the same work in every step
                     # and variant (an early EOS would differ between them)
                     generation_kwargs={"min_new_tokens": a.completion})
    return dict(model=model, reward_funcs=tm.reward_len, args=args, train_dataset=tm.dataset(64),
                processing_class=tm.tokenizer())


# --------------------------------------------------------------------------------------------------
# Step-interleaved timing (issue 31 item 6): on a shared machine a trainer run's time drifts by
# +-7-10% between runs, more than the overheads measured. Interleaving the variants one step at a
# time (a shuffled order each round) puts every slow period on all of them alike; the ratio of
# each round's step times to the peer's in the same round is then paired, and its median over the
# rounds is robust to the rounds a neighbour disturbed.
# --------------------------------------------------------------------------------------------------
def interleaved_rounds(variants, rounds, step, seed=0):
    """Runs ``step(variant)`` once per variant per round, in a shuffled order each round.
    Returns {variant: [per-round (wall, thread CPU) seconds]}."""
    import random
    import time
    rng = random.Random(seed)
    times = {v: [] for v in variants}
    for _ in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            t, c = time.perf_counter(), time.thread_time()
            step(v)
            times[v].append((time.perf_counter() - t, time.thread_time() - c))
    return times


class StepBaton:
    """Interleaves trainers that each run their own loop in a thread (TRL's ``train()``): one
    thread runs at a time; the turn passes at each step's end to the next variant of the round (a
    shuffled order each round), so the steps interleave as in ``interleaved_rounds``. Each thread
    calls ``run(variant, fn)``; ``callback(variant)`` is the transformers TrainerCallback that
    times that variant's steps and passes the turn. ``times`` as interleaved_rounds'. Each thread
    keeps its own torch RNG stream across turns (saved when it passes the turn, restored when it
    gets it back), so a variant draws what it would draw running alone."""

    def __init__(self, variants, seed=0):
        import random
        import threading
        self._rng = random.Random(seed)
        self._seed = seed
        self._cv = threading.Condition()
        self._active = list(variants)
        self._queue = []
        self._rng_states = {}
        self.times = {v: [] for v in variants}
        self._refill()

    def _refill(self):
        self._queue = list(self._active)
        self._rng.shuffle(self._queue)

    def _wait(self, v):
        import torch
        with self._cv:
            self._cv.wait_for(lambda: self._queue and self._queue[0] == v)
        if v in self._rng_states:
            torch.set_rng_state(self._rng_states[v])

    def _pass(self, v, finished=False):
        import torch
        self._rng_states[v] = torch.get_rng_state()
        with self._cv:
            if finished:
                self._active.remove(v)
            self._queue.pop(0)
            if not self._queue:
                self._refill()
            self._cv.notify_all()

    def run(self, variant, fn):
        """Runs ``fn()`` in the calling thread, holding the turn except between steps; every
        variant's torch RNG stream starts from the same seed."""
        import torch
        self._wait(variant)
        torch.manual_seed(self._seed)
        try:
            return fn()
        finally:
            self._pass(variant, finished=True)

    def callback(self, variant):
        import time
        from transformers import TrainerCallback
        baton = self

        class _Timed(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                self.t = (time.perf_counter(), time.thread_time())

            def on_step_end(self, args, state, control, **kw):
                t, c = self.t
                baton.times[variant].append((time.perf_counter() - t, time.thread_time() - c))
                baton._pass(variant)
                baton._wait(variant)
        return _Timed()


def print_paired_ratios(times, peer, cycle=1, skip=1):
    """Per-step table of interleaved times ({variant: [(wall, CPU)]}, the same rounds for every
    variant): median CPU and wall ms per step; the median over cycles of ``cycle`` rounds (TRL: 2,
    the generation and the reuse step) of each variant's CPU time / the peer's in the same cycle,
    with its interquartile range; and the ratio of the fastest cycles (a neighbour only ever adds
    time, so each variant's fastest cycle is its least disturbed one). The first ``skip`` rounds
    (first-call costs) are left out. Returns {variant: (median paired ratio, fastest-cycle
    ratio)}."""
    import statistics
    n = min(len(t) for t in times.values())
    ncyc = (n - skip) // cycle

    def cyc(v, i):
        return sum(times[v][skip + cycle * i + j][1] for j in range(cycle))
    print(f"  variant    CPU ms/step   wall ms/step   CPU / {peer}'s: median of {ncyc} paired "
          f"{cycle}-step cycles [IQR]   fastest cycles")
    out = {}
    best_peer = min(cyc(peer, i) for i in range(ncyc))
    for v in times:
        cpu = statistics.median(t[1] for t in times[v][skip:n]) * 1e3
        wall = statistics.median(t[0] for t in times[v][skip:n]) * 1e3
        r = sorted(cyc(v, i) / cyc(peer, i) for i in range(ncyc))
        q = statistics.quantiles(r, n=4) if len(r) >= 2 else [r[0]] * 3
        out[v] = (statistics.median(r), min(cyc(v, i) for i in range(ncyc)) / best_peer)
        print(f"  {v:<8} {cpu:12.1f} {wall:14.1f}   {out[v][0]:6.3f} [{q[0]:.3f}, {q[2]:.3f}]"
              f"{out[v][1]:24.3f}")
    return out
