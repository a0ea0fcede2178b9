"""Finished layers of a layer-wise conversion, kept in ``.DST.layerwise/`` beside DST so that a killed
conversion resumes at its first unfinished layer (docs/convert.md, "Scale: one decoder layer in memory").
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from gqakit.checkpoint import Checkpoint
from gqakit.errors import GqakitError
from gqakit.locks import OWNER, exclusive
from gqakit.storage import atomic_write, check_output_dir, fingerprint

STATE = "state.json"


def resume_dir(dst: str | Path) -> Path:
    """Where the finished layers of a conversion into ``dst`` are kept: ``.DST.layerwise`` beside it."""
    dst = Path(dst).expanduser().absolute()
    return dst.parent / f".{dst.name}.layerwise"


@contextmanager
def claim_layerwise(
    dst: str | Path, force: bool, src: str | Path, key: dict[str, Any]
) -> Iterator[LayerwiseResume]:
    """Hold DST's finished layers for one conversion (``.DST.lock`` beside it): a second conversion into
    the same DST while this one runs would discard or mix them, so it is refused with this one's pid.
    DST is checked first (:func:`~gqakit.storage.check_output_dir`, against ``src``: what the user
    named, :func:`gqakit.convert.write.source_path`), so a bad DST gets its own message.

    Yield the finished layers of the conversion ``key`` names (see :class:`LayerwiseResume`): removed
    when it completes or stops on bad input (a :class:`GqakitError`: nothing to resume), kept when it is
    killed (Ctrl-C, out of memory...), saying where, for the next run of the same conversion."""
    dst = check_output_dir(Path(dst), force, Path(src))
    dst.parent.mkdir(parents=True, exist_ok=True)
    busy = (
        f"Another conversion into {dst} is running ({OWNER}); it keeps its finished layers in "
        f"{resume_dir(dst)}. Wait for it to finish, or convert into another directory."
    )
    with exclusive(dst.parent / f".{dst.name}.lock", busy):
        resume = LayerwiseResume(resume_dir(dst), key)
        try:
            yield resume
        except GqakitError:
            resume.clear()
            raise
        except BaseException:
            if resume.done:
                print(
                    f"{resume.done} finished layer(s) kept in {resume.root}: run the same conversion again "
                    "to resume there.",
                    file=sys.stderr,
                )
            raise
        resume.clear()


def resume_key(ckpt: Checkpoint, options: Any, sequences: list[torch.Tensor]) -> dict[str, Any]:
    """What the finished layers of a layer-wise conversion depend on: the source's files, every option
    but ``force``, and the calibration token ids (another text or tokenizer gives other layers)."""
    origin = Path(ckpt.origin)
    tokens = hashlib.sha256()
    for s in sequences:
        tokens.update(s.to(torch.int64).contiguous().numpy().tobytes())
        tokens.update(b";")
    return {
        "source": fingerprint(origin) if origin.exists() else ckpt.origin,
        "options": {k: v for k, v in asdict(options).items() if k != "force"},
        "tokens": tokens.hexdigest()[:16],
    }


class LayerwiseResume:
    """The finished layers of one conversion, valid only for its ``key``.

    Args:
        root: the directory (:func:`resume_dir`); created when the first layer is saved.
        key: everything the layers depend on (source fingerprint, options, calibration tokens), as JSON.

    Attributes:
        done: how many layers (from layer 0, in order) are finished and saved.
        infos: per finished layer, what was measured on it (merge and refinement records, seconds).
    """

    def __init__(self, root: Path, key: dict[str, Any]) -> None:
        self.root, self.key = root, key
        self.done, self.infos = 0, []
        try:
            state = json.loads((root / STATE).read_text())
        except (OSError, json.JSONDecodeError):
            state = None
        # the states a layer left are named by it: a folder without them (an older layout) is not resumed
        if state is not None and state.get("key") == key and self._hidden(int(state["done"])).is_file():
            self.done, self.infos = int(state["done"]), list(state["infos"])
        elif root.exists():  # another conversion's layers, or a kill before the first layer was saved
            shutil.rmtree(root, ignore_errors=True)

    def layer(self, index: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Finished layer ``index``: its computed tensors by name, and what was measured on it."""
        return load_file(str(self.root / f"layer-{index:05d}.safetensors")), self.infos[index]

    def hidden(self) -> list[torch.Tensor]:
        """The calibration hidden states after the last finished layer."""
        return torch.load(self._hidden(self.done), weights_only=True)

    def _hidden(self, done: int) -> Path:
        """Where the hidden states after ``done`` finished layers are kept."""
        return self.root / f"hidden-{done - 1:05d}.pt"

    def save(
        self, index: int, values: dict[str, torch.Tensor], info: dict[str, Any], hidden: list[torch.Tensor]
    ) -> None:
        """Record layer ``index`` (the next one) as finished; the state file is written last, and the
        hidden states it supersedes removed after it, so a kill at any point leaves the previous state
        valid."""
        self.root.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in values.items()}
        with atomic_write(self.root / f"layer-{index:05d}.safetensors") as tmp:
            save_file(tensors, str(tmp))
        with atomic_write(self._hidden(index + 1)) as tmp:
            torch.save([h.cpu() for h in hidden], tmp)
        self.done, self.infos = index + 1, [*self.infos, info]
        with atomic_write(self.root / STATE) as tmp:
            tmp.write_text(json.dumps({"key": self.key, "done": self.done, "infos": self.infos}) + "\n")
        self._hidden(index).unlink(missing_ok=True)

    def clear(self) -> None:
        """Remove the saved layers (the conversion is complete)."""
        shutil.rmtree(self.root, ignore_errors=True)


__all__ = ["LayerwiseResume", "resume_dir", "resume_key"]
