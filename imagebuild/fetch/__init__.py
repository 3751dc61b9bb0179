"""imagebuild.fetch."""
