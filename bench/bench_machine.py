"""What the Python peer benchmarks print about the machine they ran on (one copy for all of them)."""
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
