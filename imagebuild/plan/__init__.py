"""Step 2, the plan: a definition -> its stages in order, with build args, inputs and content keys.

Takes a ``Definition`` (and its lock, and the engine's facts when asked) and gives a ``Plan``
(``planner.make_plan``): per stage the Dockerfile, parent, build args, every input and the key
that names them, and the build id. No side effects: it runs no build, writes no file.
- ``planner``: ``make_plan`` and the ``Plan``/``StagePlan`` records;
- ``source_mounts``: what a stage that builds git sources gets from prefetch;
- ``package_inputs``: the part of a key that comes from the wheels and debs a stage installs;
- ``provenance``: where the definition came from (its digest and git revision).
"""

__all__ = ["context_stream", "package_inputs", "planner", "provenance", "source_mounts"]
