"""`python -m llmgw.cli ...` is `llmgw ...`."""

from llmgw.cli import main

raise SystemExit(main())
