"""Load a data pipeline named on a command line: ``module:function`` or
``path/to/file.py:function``, called with ``key=value`` keyword arguments.

One loader for every command that takes a PIPELINE (``serve``, ``sweep``), so they accept
the same strings and fail with the same clear messages.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger("tensorsocket")


class PipelineError(ValueError):
    """A PIPELINE string that cannot be loaded or called; the message says what to fix."""


def convert(value: str) -> int | float | str:
    """An --arg value: int if it parses as one, else float, else the string itself."""
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def keyvalue(text: str) -> tuple[str, int | float | str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected key=value with a Python identifier as key, got {text!r}")
    return key, convert(value)


def parse(spec: str) -> tuple[str, str, bool]:
    """Split PIPELINE into (module or file path, function path, is_file). Raises PipelineError."""
    target, sep, func = spec.rpartition(":")
    if not sep or not target or not func:
        raise PipelineError(
            f"PIPELINE {spec!r} must be module:function or path/to/file.py:function "
            "(e.g. producer.synthetic:make_loader or ./pipeline.py:make_loader)"
        )
    if not all(part.isidentifier() for part in func.split(".")):
        raise PipelineError(f"PIPELINE {spec!r}: {func!r} is not a function name")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    if not is_file and not all(part.isidentifier() for part in target.split(".")):
        raise PipelineError(
            f"PIPELINE {spec!r}: {target!r} is neither a module name nor a path to a .py file"
        )
    return target, func, is_file


def _import_file(path_text: str) -> ModuleType:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise PipelineError(
            f"pipeline file {path_text!r} does not exist" + ("" if path.suffix else " (no .py?)")
        )
    path = path.resolve()
    # Import it under its own name with its folder on sys.path, so that what it defines can
    # be pickled into DataLoader worker processes started with spawn.
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = path.stem if path.stem.isidentifier() and path.stem not in sys.modules else None
    name = name or f"_tensorsocket_pipeline_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PipelineError(f"cannot import {path_text!r} as Python source")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise PipelineError(f"importing {path_text} failed: {describe(exc)}") from None
    return module


def _import_module(name: str) -> ModuleType:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:  # the console script does not put it there
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise PipelineError(
                f"no module named {exc.name!r} (looked in the current directory and the installed "
                "packages; for a file, give path/to/file.py:function)"
            ) from None
        raise PipelineError(f"importing {name} failed: {describe(exc)}") from None
    except Exception as exc:
        raise PipelineError(f"importing {name} failed: {describe(exc)}") from None


def load(spec: str) -> Callable[..., Any]:
    """The function PIPELINE names. Raises PipelineError with a clear message."""
    target, func, is_file = parse(spec)
    module = _import_file(target) if is_file else _import_module(target)
    obj: Any = module
    for part in func.split("."):
        if not hasattr(obj, part):
            public = sorted(
                n
                for n, v in vars(module).items()
                if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
            )
            hint = f"; it defines {', '.join(public[:12])}" if public else ""
            raise PipelineError(f"{target} has no function {func!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PipelineError(f"{target}:{func} is a {type(obj).__name__}, not a function")
    return obj


_ORIGINAL = "Original Traceback (most recent call last):"
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def describe(exc: BaseException) -> str:
    """One line for an exception: type, message and where it was raised. A DataLoader worker's
    error, which torch raises again in the main process with the worker's whole traceback in
    its message, is told by its first and last lines and where the worker raised it (not
    where torch raised it again)."""
    message = str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = None
    if frames and frames[-1].filename != __file__:
        where = (frames[-1].filename, frames[-1].lineno)
    if _ORIGINAL in message:
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        found = _FRAME.findall(message)
        message = f"{lines[0]} {lines[-1]}"
        if found:
            where = found[-1]
    text = f"{type(exc).__name__}: {message}"
    if where is not None:
        text += f" (at {where[0]}:{where[1]})"
    return text


def call(function: Callable[..., Any], spec: str, kwargs: dict[str, Any]) -> Any:
    """Call the pipeline function; an exception in it becomes one PipelineError line."""
    try:
        return function(**kwargs)
    except Exception as exc:
        log.debug("the pipeline raised", exc_info=True)
        raise PipelineError(f"pipeline {spec} raised {describe(exc)}") from None
