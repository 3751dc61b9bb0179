"""The secrets imagebuild may be handed (a GitHub token for the API), and their removal from text.

A token is read from the environment only where it is used (prefetch's API calls). Every text that
leaves the process for people or files (a stage's log and its live display, the nightly report) has
the values of ``SECRET_ENV`` replaced with ``REDACTED``, so even a RUN that prints one cannot leak it.
"""

from __future__ import annotations

import os

SECRET_ENV = ("GITHUB_TOKEN", "GH_TOKEN", "IMAGEBUILD_GITHUB_TOKEN")
REDACTED = "[redacted]"


def secrets_in_env() -> list[str]:
    """The values of the secret variables that are set (4 characters or more: shorter ones would
    redact ordinary text)."""
    return [v for k in SECRET_ENV if (v := os.environ.get(k)) and len(v) >= 4]


def redact_text(text: str, secrets: list[str] | tuple[str, ...]) -> str:
    for s in secrets:
        if s in text:
            text = text.replace(s, REDACTED)
    return text
