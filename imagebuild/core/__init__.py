"""imagebuild.core."""
