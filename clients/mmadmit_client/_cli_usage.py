"""The one error of ``mmadmit-client`` that is not the library's: unusable input."""

from __future__ import annotations


class UsageError(Exception):
    """An unusable argument or request file (exit status 2)."""
