"""`pdserve make-model` and `pdserve generate` run as a user runs them: real processes of the installed
command, their output checked exactly (the folder against the library's, the text against the engine's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from services import Engine, SamplingParams
from services.model_presets import write_model

# The console script the package installs, beside this interpreter (a -e install puts it there).
PDSERVE = Path(sys.executable).with_name("pdserve")


def run(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # generated text may hold any character
    return subprocess.run([str(PDSERVE), *argv], capture_output=True, text=True, encoding="utf-8", env=env,
                          timeout=300)


def test_make_model_writes_the_presets_folder_then_generate_answers_as_the_engine(tmp_path):
    out = tmp_path / "made"
    made = run("make-model", "--preset", "tiny", "--out", str(out), "--seed", "3")
    assert (made.returncode, made.stdout) == (0, f"wrote the tiny preset to {out}\n"), made.stderr
    reference = write_model("tiny", tmp_path / "reference", seed=3)
    files = sorted(p.name for p in reference.iterdir())
    assert sorted(p.name for p in out.iterdir()) == files
    assert all((out / name).read_bytes() == (reference / name).read_bytes() for name in files)

    prompts = ["Once upon a time", "The sea"]
    generated = run("generate", "--model", str(out), "--prompt", prompts[0], "--prompt", prompts[1],
                    "--max-tokens", "9")
    assert generated.returncode == 0, generated.stderr
    want = Engine(model=str(out)).generate(prompts, SamplingParams(max_tokens=9, temperature=0))
    expected = "".join(f"--- {p!r} -> {len(o.token_ids)} tokens ({o.finish_reason})\n{o.text}\n"
                       for p, o in zip(prompts, want))
    assert generated.stdout.startswith(expected), generated.stdout
    total = sum(len(o.token_ids) for o in want)
    assert re.fullmatch(rf"--- {total} tokens in \d+\.\d\d s \(\d+\.\d tokens/s\)\n", generated.stdout[len(expected):])


def test_generate_refuses_a_folder_that_is_not_a_model(tmp_path):
    refused = run("generate", "--model", str(tmp_path), "--prompt", "x")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("pdserve generate: error: ") and "config.json" in refused.stderr
