"""The heap policy: with it a large block freed is reused for the next large block with no page faults; without it
(glibc's defaults: a fresh mapping per large block) every page of the next block faults in. Each case in its own
process: the policy is process-wide."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK = 64 << 20  # past glibc's largest mmap threshold (32 MB): mapped per allocation by default
NEXT = 48 << 20  # the next block: smaller, so the freed one holds it (an aligned block of the same size may not fit
# a freed one exactly: torch asks for 64-byte alignment, which takes a few bytes more)
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# the pages a fresh mapping of the block faults in: 4 KB each, or 2 MB where every anonymous mapping gets huge pages
PAGES = NEXT // (2 << 20 if THP.exists() and "[always]" in THP.read_text() else 4096)

pytestmark = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"), reason="not glibc")

# a block allocated and freed, then the next one, every byte written: the next one's minor faults
PROBE = f"""
import json, torch
from services.heap_policy import keep_freed_memory

def minor_faults():
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])

applied = keep_freed_memory()
block = torch.ones({BLOCK}, dtype=torch.uint8)
del block
before = minor_faults()
block = torch.ones({NEXT}, dtype=torch.uint8)
print(json.dumps({{"applied": applied, "again": keep_freed_memory(), "faults": minor_faults() - before}}))
"""


def probe(setting: str | None, code: str = PROBE) -> dict:
    """`code` run in a fresh process (the policy set by `setting`, else its default): the JSON it printed last."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_KEEP_FREED_MEMORY"}
    if setting is not None:
        env["PDSERVE_KEEP_FREED_MEMORY"] = setting
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_freed_large_block_is_reused_without_faults():
    result = probe(None)
    assert result["applied"] is True and result["again"] is True
    assert result["faults"] < max(PAGES // 16, 2)  # none here (the block's pages were kept), not PAGES again


def test_switched_off_keeps_glibc_mapping_each_block():
    result = probe("0")
    assert result["applied"] is False and result["again"] is False
    assert result["faults"] >= PAGES  # a fresh mapping: every page faults in (12,289 here)


TRIM_PROBE = f"""
import json, torch
from services.heap_policy import keep_freed_memory

def resident_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))

keep_freed_memory()
block = torch.ones({BLOCK}, dtype=torch.uint8)
held = resident_mb()
del block
kept = resident_mb()
keep_freed_memory()  # an engine built: what is free goes back
print(json.dumps({{"held": held, "kept": kept, "after": resident_mb()}}))
"""


def test_what_is_free_when_an_engine_is_built_goes_back():
    mb = probe(None, TRIM_PROBE)
    block_mb = BLOCK >> 20
    assert mb["held"] - mb["kept"] < block_mb // 4  # freed, the block's pages stay with the process
    assert mb["kept"] - mb["after"] > block_mb * 3 // 4  # then handed back by the next engine's call


def test_a_bad_setting_is_refused(monkeypatch):
    import services.heap_policy as heap_policy

    monkeypatch.setattr(heap_policy, "_applied", None)
    monkeypatch.setenv("PDSERVE_KEEP_FREED_MEMORY", "yes")
    with pytest.raises(ValueError, match="PDSERVE_KEEP_FREED_MEMORY must be 0 or 1, got 'yes'"):
        heap_policy.keep_freed_memory()
