"""llmgw: an inference-aware request router for fleets of LLM model servers."""

import os

from llmgw import native as _native

# Before any scheduling module is imported: compiled extensions only if they match their
# sources (`llmgw/native.py`).
_native.STATUS = _native.install(env=os.environ)
