"""imagebuild: reproducible, offline, staged builds of vLLM serving images for DGX Spark clusters."""

__version__ = "0.1.0"
