"""The secrets imagebuild may be handed (a GitHub token for the API), and their removal from text.

A token is read from the environment only where it is used (prefetch's API calls). Every text that
leaves the process for people or files (a stage's log and its live display, the nightly report) has
the values of ``SECRET_ENV`` replaced with ``REDACTED``, so even a RUN that prints one cannot leak it,
and every URL's ``user[:password]@`` removed (``without_userinfo``).
"""

from __future__ import annotations

import os

from imagebuild.core import lazy

SECRET_ENV = ("GITHUB_TOKEN", "GH_TOKEN", "IMAGEBUILD_GITHUB_TOKEN")
REDACTED = "[redacted]"


def secrets_in_env() -> list[str]:
    """The values of the secret variables that are set (4 characters or more: shorter ones would
    redact ordinary text)."""
    return [v for k in SECRET_ENV if (v := os.environ.get(k)) and len(v) >= 4]


# a URL's userinfo: from the scheme's "://" to the last "@" before the host's end (a password may hold "@")
_USERINFO = lazy.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*)://([^/\s?#]*)@")
_SSH = ("ssh", "git+ssh", "ssh+git")


def without_userinfo(text: str, *, ssh_user: bool = True) -> str:
    """``text`` with the ``user[:password]@`` of every URL in it removed: what is shown, stored or
    compared of a URL (a source's repo, ``DOCKER_HOST``, ``--engine``, ``IMAGEBUILD_GITHUB_API``).
    ``ssh_user``: an ssh URL's bare login name (``ssh://root@dgx3``, no ``:``) is kept, being no
    credential (ssh takes no password from a URL); the lock records none at all (``ssh_user=False``)."""
    if "@" not in text or "://" not in text:
        return text

    def sub(m) -> str:
        if ssh_user and m[1].lower() in _SSH and ":" not in m[2]:
            return m[0]
        return m[1] + "://"
    return _USERINFO.sub(sub, text)


def redact_text(text: str, secrets: list[str] | tuple[str, ...]) -> str:
    """``text`` without the secrets' values and without any URL's userinfo."""
    for s in secrets:
        if s in text:
            text = text.replace(s, REDACTED)
    return without_userinfo(text)
