"""What the Python peer benchmarks print about the machine they ran on (one copy for all of them;
bench/bench_machine.h is the C++ side): the CPU model and the switchyard kernel ISA in use."""
import platform


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
                     logging_steps=10**6)
    return dict(model=model, reward_funcs=tm.reward_len, args=args, train_dataset=tm.dataset(64),
                processing_class=tm.tokenizer())
