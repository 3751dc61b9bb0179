"""imagebuild.definition."""
