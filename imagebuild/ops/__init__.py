"""Operating the pipeline: the whole chain every night, its report, and the host's upkeep.

Takes the steps below as they are and runs them for people: gives the nightly run (prefetch,
build, gate, promote, sync, gc) with its JSON and Markdown report, what changed between two images,
the disk each image holds and the retention that frees it, and the host checks.
- ``nightly``: ``imagebuild nightly``; ``report``: the run report; ``imagediff``: ``imagebuild diff``;
- ``gc``: ``imagebuild df`` and ``imagebuild gc``; ``doctor``: ``imagebuild doctor``;
- ``history``: the nights, kept for good; ``htmlpage``: them as one HTML page with charts.
- ``settings``: ``imagebuild config`` (effective settings and the environment variables).
"""

__all__ = ["doctor", "gc", "history", "htmlpage", "imagediff", "nightly", "report", "settings"]
