"""How imagebuild reaches a peer node: one SSH command prefix, used by doctor and sync.

``$IMAGEBUILD_SSH`` (default ``ssh``) is the SSH command, split like a shell would, the way
``GIT_SSH_COMMAND`` and rsync's ``-e`` work: ``IMAGEBUILD_SSH='ssh -F ~/.ssh/cluster_config'``.
"""

from __future__ import annotations

import os
import shlex

from imagebuild.core.errors import UsageError, excerpt

SSH_ENV = "IMAGEBUILD_SSH"
CONNECT_TIMEOUT_S = 5


def ssh_command() -> list[str]:
    """``$IMAGEBUILD_SSH`` split like a shell would; a UsageError (exit 2) naming it when it cannot be
    (an unbalanced quote) or names no command."""
    value = os.environ.get(SSH_ENV) or "ssh"
    try:
        argv = shlex.split(value)
    except ValueError as exc:
        raise UsageError(f"{SSH_ENV}={excerpt(value)}: cannot be split like a shell command line: {exc}",
                         hint="balance its quotes, e.g. IMAGEBUILD_SSH='ssh -F ~/.ssh/cluster_config'") from None
    if not argv:
        raise UsageError(f"{SSH_ENV}={excerpt(value)}: names no command", hint="e.g. IMAGEBUILD_SSH=ssh")
    return argv


def is_destination(dest: object) -> bool:
    """Whether ``dest`` can be handed to ssh as its destination: a non-empty name that cannot be
    read as an option (no leading ``-``) and holds no white space or control character."""
    return (isinstance(dest, str) and bool(dest) and not dest.startswith("-")
            and not any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in dest))


def check_destination(dest: str, what: str = "peer") -> str:
    """``dest`` when it is one (``is_destination``), else a UsageError (exit 2) naming it. Every
    ssh command line imagebuild makes also puts ``--`` before the destination."""
    if not is_destination(dest):
        raise UsageError(f"not an SSH destination: {dest!r} ({what})",
                         hint="dgx4, user@host or an ssh config alias; ssh options go in ~/.ssh/config or "
                         "IMAGEBUILD_SSH")
    return dest


def ssh_argv(host: str, *remote: str) -> list[str]:
    """argv that runs ``remote`` on ``host`` without ever prompting for a password."""
    check_destination(host)
    return [*ssh_command(), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", "--", host, *remote]


def host_key_trouble(text: str, host: str) -> tuple[str, str] | None:
    """(what, hint) when ssh's output ``text`` says it refused ``host`` for its host key: changed since it
    was recorded, or not recorded at all; else None. imagebuild never turns host key checking off."""
    if "IDENTIFICATION HAS CHANGED" in text or "Host key for" in text and "has changed" in text:
        return ("its host key has CHANGED since it was recorded in known_hosts (a reinstalled node, or "
                "someone in between)", f"check the key with the node's admin, then `ssh-keygen -R {host}` and "
                "connect once")
    if "Host key verification failed" in text or "host key is known" in text:
        return ("its host key is not in known_hosts", f"verify the key and add it: `ssh {host} true` once "
                f"interactively, or `ssh-keyscan {host} >> ~/.ssh/known_hosts` after checking the fingerprint")
    return None
