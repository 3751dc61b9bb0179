"""imagebuild.ops."""
