"""A minute of the soak (tests/bench/soak.py) against a real `goinfer serve` on the default model: 16 clients
mixing streamed and whole answers, clients that leave mid-stream, bad and oversize bodies. Asserted: no 5xx, no
connection dropped without an answer, the server alive, its thread count back to its baseline once idle. (Speed
and memory figures come from the 10-minute run by hand: docs/server.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_minute_of_mixed_load_leaves_the_server_as_it_found_it(smollm2_gguf):
    r = subprocess.run([sys.executable, "tests/bench/soak.py", "--model", str(smollm2_gguf), "--clients", "16",
                        "--seconds", "60"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    result = json.loads(r.stdout)
    assert r.returncode == 0 and not result["failures"], (result["failures"], r.stderr[-2000:])
    assert result["requests"] > 50
    assert not any(k.split()[1].startswith("5") for k in result["statuses"])
    assert result["threads"]["settled"] <= result["threads"]["after_warmup"]
