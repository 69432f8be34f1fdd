"""GPU memory and utilisation through nvidia-ml-py, for ``tensorsocket status``; nothing without it."""

from __future__ import annotations

from ..gpu_memory import bytes_by_pid
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
                for pid, used in bytes_by_pid(pynvml, handle).items():
                    by_pid[pid] = by_pid.get(pid, 0) + used  # the same process on several GPUs
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
