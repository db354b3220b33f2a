"""Runnable examples of tapegrad; `python -m tapegrad.demo` runs the main one."""
