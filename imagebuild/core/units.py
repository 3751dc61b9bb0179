"""How people see sizes and digests: one unit system (binary: KiB, MiB, GiB, TiB, as ``df -h`` and
docker's own sizes) and short digests (``sha256:`` + 12 hex digits, as ``docker images`` shows ids).
JSON output keeps exact byte counts and full digests; only the human forms go through here."""

from __future__ import annotations

UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; whole bytes below 1 KiB (``512 B``)."""
    for unit in UNITS:
        if abs(n) < 1024 or unit == UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} {UNITS[-1]}"  # (not reached)


def short_digest(digest: str | None) -> str:
    """``sha256:<64 hex>`` -> ``sha256:<first 12>``; a bare hex id -> its first 12; None -> ``-``."""
    if not digest:
        return "-"
    algo, sep, hexpart = digest.partition(":")
    return f"{algo}:{hexpart[:12]}" if sep else digest[:12]
