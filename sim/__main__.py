"""`python -m llmgw.sim ...` (same flags as `llmgw sim`)."""

import sys

from llmgw.sim.cli import main

sys.exit(main())
