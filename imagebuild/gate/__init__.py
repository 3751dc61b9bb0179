"""Step 5, the gate: an image -> its checks run inside a container of it -> a receipt.

Takes any image (by reference) and a gate spec, and gives a receipt keyed by (image identity, gate
spec digest): which checks ran, which passed. It knows nothing of how the image was built: the
build step calls it on its candidate, and promotion and sync read its receipts.
- ``runner``: ``run_gate`` (``imagebuild gate``), the container and the check transcript;
- ``receipts``: the receipts on disk, whether one is trusted (``check``, ``find_passing``);
- ``signing``: receipts signed and verified with OpenSSH (``ssh-keygen -Y``);
- ``leftovers``: ``reap``, the gate containers of gates killed before they could remove them.
"""

__all__ = ["leftovers", "receipts", "runner", "signing"]
