"""The layer under every step: what the whole tool stands on, and its only ways out to the world.

Takes nothing of the pipeline and knows none of it. Gives:
- ``errors``: the one exception family, each class with its exit code (the CLI maps them);
- ``run``: the one place where subprocesses start (``run``, ``Query``, interrupts);
- ``interrupts``: SIGINT, SIGTERM and SIGHUP end a run as Ctrl-C does, the first one only;
- ``fsutil``: atomic writes, the one bounded reader of regular files, content digests; ``lazy``: imports
  made on first use; ``printable``: text fit for a terminal or a log (an allow-list);
- ``context``: one command's settings (root, state, stage store, engine, output), passed down;
- ``config``: the project's ``imagebuild.yaml``; ``state``: where imagebuild keeps its state;
  ``runs``: the records of past builds; ``lock``: the lock file beside each definition;
- the systems outside: ``engine`` (the Docker engine), ``remote`` (ssh to a peer), ``remote_engine``
  (another node's engine), ``registry`` (an OCI registry, through skopeo); ``identity``: an image's
  identity, independent of the image store;
- ``secrets``: the tokens imagebuild may be handed, and their removal (and of any URL's userinfo)
  from every text it writes;
- ``emulation``: which binfmt_misc handler (QEMU user mode) runs a foreign architecture's code here;
- ``yamlread``: YAML with line numbers, so errors name the line; ``units``: sizes (binary units) and
  short digests as people read them.
"""

__all__ = ["config", "context", "emulation", "engine", "errors", "fsutil", "identity", "interrupts", "lazy", "lock", "printable", "registry", "remote", "remote_engine", "run", "runs", "secrets", "state", "units", "yamlread"]
