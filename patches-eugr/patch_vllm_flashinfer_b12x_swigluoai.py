"""Let vLLM's FlashInfer B12x MoE experts run SwiGLU-OAI (the runtime part of vLLM PR #47392).

Why: models with the clamped SwiGLU-OAI activation (swigluoai_uninterleave, gpt-oss style, with
alpha/beta/limit) cannot use the FlashInfer B12x MoE backend: vLLM neither maps the activation nor
passes its parameters to FlashInfer's B12xMoEWrapper, and the NVFP4 backend oracle does not count
B12x among the backends that apply the clamp. PR #47392 fixes that; this is its production subset
(no tests or docs), active only when the installed FlashInfer's wrapper takes the parameters.
Edits, in order: the expert class (helper import, activation map entry, parameter resolution,
supported-activation check, keyword forwarding), the FlashInfer capability helper and its export,
and the oracle's clamp set.
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_flashinfer_b12x_swigluoai.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

_EXPERTS = "vllm/model_executor/layers/fused_moe/experts/flashinfer_b12x_moe.py"
_UTILS = "vllm/utils/flashinfer.py"
_ORACLE = "vllm/model_executor/layers/fused_moe/oracle/nvfp4.py"
_HELPER = "has_flashinfer_b12x_moe_activation"
_DONE = f"def {_HELPER}("  # upstream's helper: PR #47392 (or an equivalent) is in

_RESOLVE = """\
        self._activation_str = self._ACTIVATION_MAP[activation]
        # imagebuild-patch: b12x-swigluoai/params (quant_config first, then moe_config)
        self.swiglu_alpha = (
            quant_config.gemm1_alpha
            if quant_config.gemm1_alpha is not None
            else moe_config.swiglu_alpha
        )
        self.swiglu_beta = (
            quant_config.gemm1_beta
            if quant_config.gemm1_beta is not None
            else moe_config.swiglu_beta
        )
        self.swiglu_limit = (
            quant_config.gemm1_clamp_limit
            if quant_config.gemm1_clamp_limit is not None
            else moe_config.swiglu_limit
        )
        if activation == MoEActivation.SWIGLUOAI_UNINTERLEAVE and self.swiglu_limit is None:
            raise ValueError(
                "swigluoai_uninterleave needs a swiglu_limit (gemm1_clamp_limit); none was given"
            )
        if activation != MoEActivation.SWIGLUOAI_UNINTERLEAVE and self.swiglu_limit is not None:
            raise ValueError(
                f"FlashInfer B12x applies swiglu_limit only with swigluoai_uninterleave, not {activation}"
            )
"""

_SUPPORTS = """\
    def _supports_activation(activation: MoEActivation) -> bool:
        # imagebuild-patch: b12x-swigluoai/supports (only when FlashInfer takes the parameters)
        if activation == MoEActivation.SWIGLUOAI_UNINTERLEAVE:
            return has_flashinfer_b12x_moe_activation()
"""

_KWARGS = """\
        # imagebuild-patch: b12x-swigluoai/kwargs (vLLM's unset alpha/beta are 1.0/0.0, FlashInfer's 1.702/1.0)
        swiglu_kwargs: dict[str, float] = {}
        if self.swiglu_limit is not None:
            swiglu_kwargs = {
                "swiglu_limit": self.swiglu_limit,
                "swiglu_alpha": 1.0 if self.swiglu_alpha is None else self.swiglu_alpha,
                "swiglu_beta": 0.0 if self.swiglu_beta is None else self.swiglu_beta,
            }
        self._wrapper = B12xMoEWrapper(
"""

_HELPER_DEF = '''\
@functools.cache
def has_flashinfer_b12x_moe_activation() -> bool:  # imagebuild-patch: b12x-swigluoai/helper
    """True when FlashInfer's B12xMoEWrapper accepts the SwiGLU-OAI parameters."""
    if not has_flashinfer_b12x_moe():
        return False
    mod = _get_submodule("flashinfer.fused_moe")
    wrapper = getattr(mod, "B12xMoEWrapper", None) if mod is not None else None
    if wrapper is None:
        return False
    import inspect

    return "swiglu_limit" in inspect.signature(wrapper).parameters


@functools.cache
def has_nvidia_artifactory() -> bool:
'''

_ORACLE_HELPER = '''\
from vllm.utils.flashinfer import has_flashinfer_b12x_moe_activation  # imagebuild-patch: b12x-swigluoai/oracle-import

logger = init_logger(__name__)


def _imagebuild_b12x_clamp_backends(config) -> set:
    """FLASHINFER_B12X applies the SwiGLU clamp for swigluoai_uninterleave, when FlashInfer can."""
    if (
        config.activation == MoEActivation.SWIGLUOAI_UNINTERLEAVE
        and has_flashinfer_b12x_moe_activation()
    ):
        return {NvFp4MoeBackend.FLASHINFER_B12X}
    return set()
'''

EDITS = [
    # the expert class
    Edit(file=_EXPERTS, anchor="    has_flashinfer_b12x_moe,\n",
         replacement="    has_flashinfer_b12x_moe,\n"
                     "    has_flashinfer_b12x_moe_activation,  # imagebuild-patch: b12x-swigluoai/import\n",
         marker="imagebuild-patch: b12x-swigluoai/import",
         upstream=[f"    {_HELPER},\n"], reason="capability helper imported"),
    Edit(file=_EXPERTS, anchor='        MoEActivation.RELU2_NO_MUL: "relu2",\n',
         replacement='        MoEActivation.RELU2_NO_MUL: "relu2",\n'
                     '        MoEActivation.SWIGLUOAI_UNINTERLEAVE: "swigluoai_uninterleave",'
                     "  # imagebuild-patch: b12x-swigluoai/map\n",
         marker="imagebuild-patch: b12x-swigluoai/map",
         upstream=['MoEActivation.SWIGLUOAI_UNINTERLEAVE: "swigluoai_uninterleave"'],
         reason="activation name mapped for FlashInfer"),
    Edit(file=_EXPERTS, anchor="        self._activation_str = self._ACTIVATION_MAP[activation]\n",
         replacement=_RESOLVE, marker="imagebuild-patch: b12x-swigluoai/params",
         upstream=["self.swiglu_limit = "], reason="SwiGLU parameters resolved"),
    Edit(file=_EXPERTS, anchor="    def _supports_activation(activation: MoEActivation) -> bool:\n",
         replacement=_SUPPORTS, marker="imagebuild-patch: b12x-swigluoai/supports",
         upstream=["and has_flashinfer_b12x_moe_activation()"],
         reason="swigluoai_uninterleave supported when FlashInfer can"),
    Edit(file=_EXPERTS, anchor="        self._wrapper = B12xMoEWrapper(\n",
         replacement=_KWARGS, marker="imagebuild-patch: b12x-swigluoai/kwargs",
         upstream=["swiglu_kwargs"], reason="SwiGLU keyword arguments built"),
    Edit(file=_EXPERTS, anchor="            activation=self._activation_str,\n",
         replacement="            activation=self._activation_str,\n"
                     "            **swiglu_kwargs,  # imagebuild-patch: b12x-swigluoai/forward\n",
         marker="imagebuild-patch: b12x-swigluoai/forward",
         upstream=["**swiglu_kwargs,"], reason="SwiGLU keyword arguments passed to B12xMoEWrapper"),
    # the capability helper
    Edit(file=_UTILS, anchor="@functools.cache\ndef has_nvidia_artifactory() -> bool:\n",
         replacement=_HELPER_DEF, marker="imagebuild-patch: b12x-swigluoai/helper",
         upstream=[_DONE], reason="has_flashinfer_b12x_moe_activation() added"),
    Edit(file=_UTILS, anchor='    "has_flashinfer_b12x_moe",\n',
         replacement='    "has_flashinfer_b12x_moe",\n'
                     f'    "{_HELPER}",  # imagebuild-patch: b12x-swigluoai/export\n',
         marker="imagebuild-patch: b12x-swigluoai/export",
         upstream=[f'"{_HELPER}",'], reason="helper exported"),
    # the NVFP4 backend oracle
    Edit(file=_ORACLE, anchor="from vllm.logger import init_logger\n",
         replacement="from vllm.logger import init_logger\n"
                     "from vllm.model_executor.layers.fused_moe.activation import MoEActivation"
                     "  # imagebuild-patch: b12x-swigluoai/oracle-activation\n",
         marker="imagebuild-patch: b12x-swigluoai/oracle-activation",
         upstream=["fused_moe.activation import MoEActivation"], reason="MoEActivation imported"),
    Edit(file=_ORACLE, anchor="logger = init_logger(__name__)\n",
         replacement=_ORACLE_HELPER, marker="imagebuild-patch: b12x-swigluoai/oracle-import",
         upstream=[f"import {_HELPER}"], reason="clamp-set helper added"),
    Edit(file=_ORACLE, anchor="    NVFP4_BACKENDS_WITH_CLAMP = {\n",
         replacement="    # imagebuild-patch: b12x-swigluoai/clamp (B12x joins when FlashInfer can clamp)\n"
                     "    NVFP4_BACKENDS_WITH_CLAMP = _imagebuild_b12x_clamp_backends(config) | {\n",
         marker="imagebuild-patch: b12x-swigluoai/clamp",
         upstream=["NVFP4_BACKENDS_WITH_CLAMP.add(NvFp4MoeBackend.FLASHINFER_B12X)"],
         reason="FLASHINFER_B12X counted among the backends that apply the clamp"),
]
