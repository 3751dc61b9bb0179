import sys

from imagebuild.cli.main import main

sys.exit(main())
