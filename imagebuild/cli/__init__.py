"""imagebuild.cli."""
