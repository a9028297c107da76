"""`python -m pipeline` is the `voicebus` command."""

import sys

from pipeline.cli import main

sys.exit(main())
