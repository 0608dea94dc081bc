"""CPU tests: Triton kernels run in the interpreter.

It must be chosen before triton is first imported, hence here rather than in each test module.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
