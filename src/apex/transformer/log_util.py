"""NVIDIA Apex's transformer logging helpers: ``get_transformer_logger(name)`` (the logger named after a module's
file name without its extension, as upstream's modules call it with ``__name__``) and
``set_logging_level(verbosity)`` (the level of the ``apex`` logger, every apex logger's parent)."""

from __future__ import annotations

import logging
import os

__all__ = ["get_transformer_logger", "set_logging_level"]


def get_transformer_logger(name: str) -> logging.Logger:
    """``logging.getLogger`` of ``name`` without an extension ("pkg/mod.py" -> "pkg/mod")."""
    if not isinstance(name, str):
        raise TypeError(f"get_transformer_logger: name must be a str, got {type(name).__name__}")
    return logging.getLogger(os.path.splitext(name)[0])


def set_logging_level(verbosity) -> None:
    """Sets the ``apex`` logger's level (an int such as ``logging.INFO``, or a level name such as "INFO")."""
    if isinstance(verbosity, bool) or not isinstance(verbosity, (int, str)):
        raise TypeError(f"set_logging_level: verbosity must be a logging level (int or name), got "
                        f"{type(verbosity).__name__}")
    logging.getLogger("apex").setLevel(verbosity)
