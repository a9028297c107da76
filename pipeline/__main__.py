"""`python -m voicebus` is the `voicebus` command."""

import sys

from voicebus.cli import main

sys.exit(main())
