"""GPU memory and utilisation through nvidia-ml-py, for ``tensorsocket status``; nothing without it."""

from __future__ import annotations

from .common import fmt_bytes


def gpu_usage() -> tuple[list[str], dict[int, int]]:
    """Per GPU a line of memory and utilisation, and the GPU memory of each process by pid,
    through nvidia-ml-py; nothing without it or without a GPU."""
    try:
        import pynvml
    except Exception:
        return [], {}
    try:
        pynvml.nvmlInit()
    except Exception:
        return [], {}
    lines: list[str] = []
    by_pid: dict[int, int] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
            lines.append(
                f"gpu {i} {name}: memory {fmt_bytes(mem.used)} / {fmt_bytes(mem.total)}, "
                f"utilisation {util.gpu}%"
            )
            try:
                for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    used = getattr(proc, "usedGpuMemory", None)
                    if isinstance(used, int):  # None where the driver does not tell
                        by_pid[proc.pid] = by_pid.get(proc.pid, 0) + used
            except Exception:
                pass
    except Exception:
        pass
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return lines, by_pid


def gpu_lines() -> list[str]:
    """GPU memory and utilisation through nvidia-ml-py; [] without it or without a GPU."""
    return gpu_usage()[0]
