"""Release the profiling run's cached CUDA memory before vLLM sizes and allocates the KV cache.

Why: on DGX Spark (GPU and CPU share 128 GB), the warmup/profile run leaves blocks reserved in
PyTorch's caching allocator. vLLM then measures free memory with those reservations still held and
charges them against the KV cache. Two steps fix it: after profiling, free what the profile run
left (the runner's own profiling KV cache when it has one), collect, synchronize, empty the cache
and measure again before the KV budget is computed; and empty the cache once more right before
the KV cache is allocated.
Shapes (each a test fixture): the legacy one (free memory read from the profile result), the B12X
fork's (a final MemorySnapshot after profiling: the leftovers are dropped before it is taken), and a
tree that already measures again after its own cleanup (not needed). Newer accounting that keeps a
transient_peak_headroom in the profile result keeps it counted.
Ported from the seed's patch set (eugr/spark-vllm-docker,
docker/patch_vllm_spark_kv_cache_cleanup.py: read for what it changes, not copied).
"""
from imagebuild_patching import Edit

_POST_PROFILE = """\
        # imagebuild-patch: spark-kv-cleanup/post-profile (UMA: drop profiling leftovers, measure again)
        if self.device_config.device_type == "cuda":
            _free_before = profile_result.after_profile.free_memory
            _drop = getattr(self.model_runner, "_cleanup_profiling_kv_cache", None)
            if _drop is not None:
                _drop()
            import gc as _gc

            _gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            profile_result.after_profile.measure()
            profile_result.non_torch_increase = (
                profile_result.after_profile - profile_result.before_create
            ).non_torch_memory
            profile_result.non_kv_cache_memory = (
                profile_result.non_torch_increase
                + profile_result.torch_peak_increase
                + profile_result.weights_memory
                # newer accounting keeps headroom for transient peaks: keep it counted
                + getattr(profile_result, "transient_peak_headroom", 0)
            )
            self.non_torch_memory = profile_result.non_torch_increase
            _freed = profile_result.after_profile.free_memory - _free_before
            if _freed > 0:
                logger.info(
                    "Released %.2f GiB left by the profile run before KV cache sizing",
                    _freed / (1 << 30),
                )
        free_gpu_memory = profile_result.after_profile.free_memory
"""

# The B12X fork's shape: free memory is read from a final snapshot taken after profiling, and what
# the snapshot finds missing is charged as late persistent memory. Dropping the leftovers before that
# snapshot is taken gives the same fix without touching the fork's accounting.
_B12X_ANCHOR = "        final_profile_snapshot = MemorySnapshot(device=self.device)\n"
_B12X_POST_PROFILE = """\
        # imagebuild-patch: spark-kv-cleanup/post-profile (UMA: drop profiling leftovers before the final snapshot)
        if self.device_config.device_type == "cuda":
            _drop = getattr(self.model_runner, "_cleanup_profiling_kv_cache", None)
            if _drop is not None:
                _drop()
            import gc as _gc

            _gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
""" + _B12X_ANCHOR

_PRE_ALLOC = '''\
    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate GPU KV cache with the specified kv_cache_config."""
        # imagebuild-patch: spark-kv-cleanup/pre-alloc (empty the caching allocator first)
        if self.device_config.device_type == "cuda":
            import gc as _gc

            _gc.collect()
            torch.cuda.synchronize(self.device)
            _cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            torch.cuda.empty_cache()
            if _cached > 0:
                logger.info(
                    "Released %.2f GiB of cached CUDA allocator memory before KV cache allocation",
                    _cached / (1 << 30),
                )
'''

EDITS = [
    Edit(
        file="vllm/v1/worker/gpu_worker.py",
        anchor="        free_gpu_memory = profile_result.after_profile.free_memory\n",
        replacement=_POST_PROFILE,
        marker="imagebuild-patch: spark-kv-cleanup/post-profile",
        alternatives=[(_B12X_ANCHOR, _B12X_POST_PROFILE)],
        # the worker's KV sizing: not there -> not applicable; there in an unknown shape -> fails
        applies_if=["def determine_available_memory("],
        # upstream (or an equivalent patch) measuring again after a post-profile cleanup
        upstream=["profile_result.after_profile.measure()"],
        reason="profiling leftovers released and free memory measured again before KV sizing",
    ),
    Edit(
        file="vllm/v1/worker/gpu_worker.py",
        anchor=(
            "    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:\n"
            '        """Allocate GPU KV cache with the specified kv_cache_config."""\n'
        ),
        replacement=_PRE_ALLOC,
        marker="imagebuild-patch: spark-kv-cleanup/pre-alloc",
        upstream=["torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)"],
        reason="the caching allocator is emptied before the KV cache is allocated",
    ),
]
