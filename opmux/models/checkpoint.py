"""Loading Hugging Face checkpoint directories (``config.json`` + ``*.safetensors``).

Weights are read with ``safetensors`` only: a directory that holds pickle files
(``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) and no safetensors is refused, never
unpickled. Every tensor the model needs must be present with its full shape, and every
tensor present must be used (rotary ``inv_freq`` buffers and a tied ``lm_head.weight``
excepted); the error lists the names. Nothing is loaded into the model before all checks
pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import torch

from opmux.core.errors import ConfigError, OpmuxError
from opmux.models.config import read_config
from opmux.models.decoder import CausalLM

__all__ = ["CheckpointError", "load_model"]

_PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_LISTED: Final = 8


class CheckpointError(OpmuxError, ValueError):
    """A checkpoint directory whose tensors do not fit its config (or cannot be read safely)."""


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else "")


def _ignored(name: str, tied: bool) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight")


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> CausalLM:
    """Build the checkpoint's model from opmux layers and load its weights.

    Under tensor parallelism (``opmux.distributed.init_tensor_parallel`` first) each rank
    keeps its own shards.

    :param directory: a Hugging Face checkpoint directory.
    :param dtype: ``torch.float32`` or ``torch.bfloat16`` (weights are cast).
    :raises opmux.ConfigError: a bad ``config.json`` (see :func:`read_config`), or an
        unsupported dtype.
    :raises CheckpointError: no safetensors (pickle-only checkpoints are refused), missing or
        unexpected tensors (names listed), or a tensor of the wrong shape.
    """
    from safetensors import safe_open

    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"load_model: dtype must be float32, bfloat16 or float16, got {dtype}")
    directory = Path(directory)
    cfg = read_config(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{directory}: only pickle weight files ({_names(pickles)}); opmux reads "
                f"*.safetensors only and never unpickles (convert the checkpoint, e.g. with "
                f"safetensors.torch.save_file)")
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    model = CausalLM(cfg, dtype)
    targets = model.weight_targets()
    handles = [safe_open(str(f), framework="pt") for f in files]
    where: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for i, h in enumerate(handles):
        for name in h.keys():
            where[name] = i
            shapes[name] = tuple(h.get_slice(name).get_shape())
    missing = sorted(n for n in targets if n not in where)
    extra = sorted(n for n in where if n not in targets
                   and not _ignored(n, cfg.tie_word_embeddings))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {_names(missing)}")
        if extra:
            parts.append(f"{len(extra)} unexpected: {_names(extra)}")
        raise CheckpointError(f"{directory}: tensors do not match {cfg.architecture} with this "
                              f"config.json ({'; '.join(parts)})")
    bad = [f"{n} {list(shapes[n])} (expected {list(shape)})"
           for n, (shape, _) in targets.items() if shapes[n] != shape]
    if bad:
        raise CheckpointError(f"{directory}: tensor shapes do not match config.json: "
                              f"{_names(bad)}")
    with torch.no_grad():
        for name, (_, load) in targets.items():
            load(handles[where[name]].get_tensor(name).to(dtype))
    model.eval()
    if device is not None:
        model.to(device)
    return model
