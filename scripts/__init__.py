"""Runnable examples (``python -m scripts.<name>`` from the repository root) beside the set-up shell scripts."""
