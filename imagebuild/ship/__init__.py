"""imagebuild.ship."""
