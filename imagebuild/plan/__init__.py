"""imagebuild.plan."""
