"""imagebuild.build."""
