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
