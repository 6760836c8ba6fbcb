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
from typing import Any, Final

import torch

from opmux.core.errors import ConfigError, OpmuxError
from opmux.distributed import get_tensor_model_parallel_world_size
from opmux.models.config import read_config
from opmux.models.decoder import CausalLM
from opmux.models.memory import check_fits, model_needs

__all__ = ["CheckpointError", "load_model"]

_PICKLE_SUFFIXES: Final = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_LISTED: Final = 8
_FLOAT_DTYPES: Final = frozenset({"F16", "BF16", "F32", "F64"})


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
    :raises CheckpointError: no safetensors (pickle-only checkpoints are refused), a weight
        file that is not a readable safetensors file (named), a tensor in two files, missing
        or unexpected tensors (names listed), a tensor of the wrong shape or not floating
        point.
    :raises opmux.models.MemoryBudgetError: the weights and caches the config implies do not
        fit the memory available (checked before they are allocated).
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"load_model: dtype must be float32, bfloat16 or float16, got {dtype}")
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"{directory}: not a checkpoint directory (it does not exist or is "
                          f"not a directory)")
    cfg = read_config(directory)
    files = _weight_files(directory)
    # what the sizes imply is checked before anything of that size is allocated
    needs = model_needs(cfg, dtype, get_tensor_model_parallel_world_size())
    check_fits(needs, "cpu", f"{directory / 'config.json'}")
    if device is not None and torch.device(device).type != "cpu":
        check_fits(needs, device, f"{directory / 'config.json'}")
    handles, where, shapes, dtypes = _open_all(directory, files)
    model = CausalLM(cfg, dtype)
    targets = model.weight_targets()
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
    not_float = sorted(f"{n} ({dtypes[n]})" for n in targets if dtypes[n] not in _FLOAT_DTYPES)
    if not_float:
        raise CheckpointError(f"{directory}: weights must be floating point, got "
                              f"{_names(not_float)}; convert the checkpoint")
    with torch.no_grad():
        for name, (_, load) in targets.items():
            try:
                tensor = handles[where[name]].get_tensor(name)
            except Exception as exc:  # SafetensorError: the data part is damaged
                raise CheckpointError(f"{files[where[name]]}: tensor {name!r} cannot be read "
                                      f"({_first_line(exc)})") from None
            load(tensor.to(dtype))
    model.eval()
    if device is not None:
        model.to(device)
    return model


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:160]


def _weight_files(directory: Path) -> list[Path]:
    """The ``*.safetensors`` files (regular files only), or why there are none."""
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot be listed ({exc.strerror})") from None
    files = []
    for path in entries:
        if path.suffix != ".safetensors":
            continue
        try:
            regular = path.is_file()
        except OSError as exc:  # a symlink loop (ELOOP), a name too long, ...
            raise CheckpointError(f"{path}: cannot be opened ({exc.strerror})") from None
        if not regular:
            reason = "a broken or looping link" if path.is_symlink() or not path.exists() \
                else "not a regular file"
            raise CheckpointError(f"{path}: {reason}; a weight file must be a safetensors "
                                  f"file")
        files.append(path)
    if not files:
        pickles = sorted(p.name for p in entries if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise CheckpointError(
                f"{directory}: only pickle weight files ({_names(pickles)}); opmux reads "
                f"*.safetensors only and never unpickles (convert the checkpoint, e.g. with "
                f"safetensors.torch.save_file)")
        raise CheckpointError(f"{directory}: no *.safetensors weight files")
    return files


def _open_all(directory: Path, files: list[Path]) -> tuple[
        list[Any], dict[str, int], dict[str, tuple[int, ...]], dict[str, str]]:
    """Open every shard; index each tensor's file, shape and dtype (headers only)."""
    from safetensors import safe_open

    handles = []
    where: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for i, f in enumerate(files):
        try:
            h = safe_open(str(f), framework="pt")
            names = list(h.keys())
            for name in names:
                sl = h.get_slice(name)
                shapes[name] = tuple(sl.get_shape())
                dtypes[name] = str(sl.get_dtype())
                if name in where:
                    raise CheckpointError(
                        f"{directory}: tensor {name!r} is in two files ({files[where[name]].name} "
                        f"and {f.name}); keep it in one")
                where[name] = i
        except CheckpointError:
            raise
        except Exception as exc:  # SafetensorError (truncated, empty, not safetensors), OSError
            raise CheckpointError(f"{f}: not a readable safetensors file ({_first_line(exc)})"
                                  ) from None
        handles.append(h)
    return handles, where, shapes, dtypes
