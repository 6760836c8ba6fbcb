"""Run by test_transformers_providers.py in a fresh process (OPMUX_TRACE and OPMUX_PRIORITY
are read at start-up): enable each named architecture, run generate and generate_batch, and
check the tokens against plain transformers; the trace file is written at exit.

Usage: python _transformers_trace_run.py ARCH [ARCH ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _transformers_models import build, greedy, greedy_batch

from opmux.integrations import transformers as otf

for arch in sys.argv[1:]:
    model = build(arch)
    model.generation_config.eos_token_id = None
    plain = greedy(model, 4)
    otf.enable(model)
    if greedy(model, 4) != plain:
        raise SystemExit(f"{arch}: generate differs from plain transformers")
    if greedy_batch(model, 4) != plain:
        raise SystemExit(f"{arch}: generate_batch differs from plain generate")
print("ok")
