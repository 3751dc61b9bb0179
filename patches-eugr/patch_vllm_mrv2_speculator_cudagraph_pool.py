"""Keep the speculator's CUDA-graph managers in the throwaway pool during MRv2 graph profiling.

Why: vLLM PR #53306 added a preliminary CUDA-graph memory-profiling capture to the V2 model
runner (MRv2). It points the main graph manager and the existing wrappers at a throwaway graph
pool, but MTP and other speculators own separate prefill/decode CudaGraphManager instances: their
profiling graphs land in the persistent global pool and leave its allocator handle stale before
the real FULL capture. The speculator's managers now share the throwaway pool while profiling,
and their profiling graphs are dropped with it.
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_mrv2_speculator_cudagraph_pool.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

_FILE = "vllm/v1/worker/gpu/cudagraph_utils.py"

EDITS = [
    Edit(
        file=_FILE,
        anchor=(
            "    all_wrappers: list[Any] = []\n"
            "    original_pools: dict[int, Any] = {}\n"
            "    try:\n"
        ),
        replacement=(
            "    all_wrappers: list[Any] = []\n"
            "    original_pools: dict[int, Any] = {}\n"
            "    # imagebuild-patch: mrv2-spec-pool/state (the speculator's own graph managers)\n"
            "    spec_managers: list[tuple[str, Any]] = []\n"
            "    try:\n"
        ),
        marker="imagebuild-patch: mrv2-spec-pool/state",
        applies_if=["graph_pool_handle"],  # the MRv2 graph-profiling pool of vLLM PR #53306: not there -> not applicable
        upstream=["def _profiling_cudagraph_managers("],
        reason="profiling state also tracks the speculator's graph managers",
    ),
    Edit(
        file=_FILE,
        anchor="        manager.pool = current_platform.graph_pool_handle()\n",
        replacement=(
            "        manager.pool = current_platform.graph_pool_handle()\n"
            "        # imagebuild-patch: mrv2-spec-pool/redirect (speculator graphs go to the throwaway pool too)\n"
            "        if runner.speculator is not None:\n"
            "            spec_managers = [\n"
            "                (attr, value)\n"
            "                for attr, value in vars(runner.speculator).items()\n"
            "                if isinstance(value, CudaGraphManager)\n"
            "            ]\n"
            "            for _attr, spec_manager in spec_managers:\n"
            "                spec_manager.pool = manager.pool\n"
        ),
        marker="imagebuild-patch: mrv2-spec-pool/redirect",
        applies_if=["graph_pool_handle"],  # the MRv2 graph-profiling pool of vLLM PR #53306: not there -> not applicable
        upstream=["def _profiling_cudagraph_managers("],
        reason="speculator graph managers share the throwaway profiling pool",
    ),
    Edit(
        file=_FILE,
        anchor=(
            "        CUDAGraphWrapper.clear_all_graphs()\n"
            "        BreakableCUDAGraphWrapper.clear_all_graphs()\n"
        ),
        replacement=(
            "        CUDAGraphWrapper.clear_all_graphs()\n"
            "        BreakableCUDAGraphWrapper.clear_all_graphs()\n"
            "        # imagebuild-patch: mrv2-spec-pool/cleanup (drop the speculator's profiling graphs)\n"
            "        for attr, spec_manager in spec_managers:\n"
            "            spec_manager.graphs.clear()\n"
            "            spec_manager.pool = None\n"
            "            if getattr(runner.speculator, attr, None) is spec_manager:\n"
            "                setattr(runner.speculator, attr, None)\n"
        ),
        marker="imagebuild-patch: mrv2-spec-pool/cleanup",
        applies_if=["graph_pool_handle"],  # the MRv2 graph-profiling pool of vLLM PR #53306: not there -> not applicable
        upstream=["def _profiling_cudagraph_managers("],
        reason="the speculator's profiling graphs are dropped with the throwaway pool",
    ),
]
