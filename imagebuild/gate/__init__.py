"""imagebuild.gate."""
