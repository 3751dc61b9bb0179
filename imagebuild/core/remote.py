"""How imagebuild reaches a peer node: one SSH command prefix, used by doctor and sync.

``$IMAGEBUILD_SSH`` (default ``ssh``) is the SSH command, split like a shell would, the way
``GIT_SSH_COMMAND`` and rsync's ``-e`` work: ``IMAGEBUILD_SSH='ssh -F ~/.ssh/cluster_config'``.
"""

from __future__ import annotations

import os
import shlex

SSH_ENV = "IMAGEBUILD_SSH"
CONNECT_TIMEOUT_S = 5


def ssh_command() -> list[str]:
    return shlex.split(os.environ.get(SSH_ENV) or "ssh")


def ssh_argv(host: str, *remote: str) -> list[str]:
    """argv that runs ``remote`` on ``host`` without ever prompting for a password."""
    return [*ssh_command(), "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", host, *remote]
