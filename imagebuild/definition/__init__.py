"""Step 1, the definition: ``docker-images/<name>/`` read and validated into a frozen model.

Takes the files of one definition folder (versions.env, image.yaml, the Dockerfiles, gate.yaml, the
patches) and gives a ``Definition`` (``reader.load``) or every problem at once as a
``DefinitionError``, each naming file, line and key. Reads only; writes nothing but versions.env's
pins, in place (``envfile``, for prefetch). Entry points:
- ``reader``: ``load``, ``list_images`` and the model's records (``Definition``, ``Stage``, ...);
- ``gatespec``: the gate spec (``gate.yaml``) and its digest; ``pkgspec``: wheels and apt lists;
- ``source_options``: how prefetch treats each git source; ``dockerfile``: the parts of a Dockerfile
  planning reads; ``envfile``: versions.env's reader and in-place writer;
- ``patching``: the anchor-patch primitive every ``patch_*.py`` imports (shipped into the build).
"""

__all__ = ["dockerfile", "envfile", "gatespec", "patchcheck", "patching", "pkgspec", "reader", "source_options"]
