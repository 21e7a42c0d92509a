"""The kernel plan's choices measured on this host before, kept in the pdserve cache folder across starts."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from types import ModuleType

import torch

from services.kernels import native as native_build


@dataclass
class ChoiceCache:
    """Choices measured on this host before, in `<cache>/kernels/choices.json`, keyed by the host."""

    path: os.PathLike
    host: str
    entries: dict[str, str]
    dirty: bool = False

    @classmethod
    def open(cls, native: ModuleType | None, path: os.PathLike, timing: int) -> ChoiceCache:
        """This host's entries in `path`: the host is the CPU model, torch, the native build (or its absence), the
        thread count and the plan's timing method (`timing`), so a change of any of them measures again."""
        build = native_build.build_key() if native else "off"
        host = (f"{native_build.cpu_model()} | torch {torch.__version__} | native {build} | "
                f"{torch.get_num_threads()} threads | timing {timing}")
        return cls(path, host, _read_json(path).get(host, {}))

    def get(self, entry: str, found: dict) -> str | None:
        name = self.entries.get(entry)
        return name if name in found else None

    def put(self, entry: str, name: str) -> int:
        if self.entries.get(entry) == name:
            return 0
        self.entries[entry], self.dirty = name, True
        return 1

    def save(self) -> None:
        if not self.dirty:
            return
        everything = _read_json(self.path)  # other hosts' and other processes' entries stay
        everything.setdefault(self.host, {}).update(self.entries)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(everything, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old file or the new one


def _read_json(path: os.PathLike) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
