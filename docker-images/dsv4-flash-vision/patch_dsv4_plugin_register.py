"""Make the DSV4 vision plugin register itself through vLLM's general-plugins entry point.

Why (seed, 2026-08-31): the plugin is only loaded when its distribution declares a
`vllm.general_plugins` entry point and its package has the `register()` that entry point names;
the operators' vendored copy had lost the registration (a flaky raw download) and the model never
appeared. Applied to the plugin's source tree (the DSV4_PLUGIN source, `docker/plugin`), before
it is installed. At the pinned plugin commit both are already there: "not needed".
"""
from imagebuild_patching import Edit

_REGISTER = '''\
"""vLLM general plugin for DeepSeek-V4-Flash-Vision-Exp."""

__all__ = ["register"]  # imagebuild-patch: dsv4-plugin-register


def register() -> None:
    """Called by vLLM in every process (entry point group vllm.general_plugins)."""
    from vllm.model_executor.models.registry import ModelRegistry

    for arch in ("DeepseekV4ForCausalLM", "DeepseekV4VisionForCausalLM"):
        ModelRegistry.register_model(arch, "dsv4_vision.model:DeepseekV4VisionForCausalLM")
'''

EDITS = [
    Edit(
        file="pyproject.toml",
        anchor="[tool.setuptools.packages.find]\n",
        replacement=(
            '[project.entry-points."vllm.general_plugins"]  # imagebuild-patch: dsv4-plugin-entry-point\n'
            'dsv4_vision = "dsv4_vision:register"\n'
            "\n"
            "[tool.setuptools.packages.find]\n"
        ),
        marker="imagebuild-patch: dsv4-plugin-entry-point",
        upstream=['[project.entry-points."vllm.general_plugins"]'],
        reason="entry point dsv4_vision declared in group vllm.general_plugins",
    ),
    Edit(
        file="dsv4_vision/__init__.py",
        anchor='"""vLLM general plugin for DeepSeek-V4-Flash-Vision-Exp."""\n',
        replacement=_REGISTER,
        marker="imagebuild-patch: dsv4-plugin-register",
        upstream=['"dsv4_vision.model:DeepseekV4VisionForCausalLM"'],
        reason="register() registers the vision wrapper's architectures",
    ),
]
