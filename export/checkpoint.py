"""Loading trained weights: state_dicts from either seed class, our own checkpoints, safetensors.

The seed classes' parameter names are mapped to ours here and nowhere else:
    seed 000 MultiHeadAttention   Wq / Wk / Wv / Wo
    seed 002 Multiheadattention   to_q / to_k / to_v / to_out   (our names too)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from attnserve.export.attention import MultiHeadAttention
from attnserve.export.config import AttentionConfig
from torch import Tensor

from attnserve.files import FileRefused, check_regular

FORMAT = "attnserve.attention/1"
PROJECTIONS = ("to_q", "to_k", "to_v", "to_out")
_SEED_NAMES = {"Wq": "to_q", "Wk": "to_k", "Wv": "to_v", "Wo": "to_out"}
# Prefixes that wrappers add: DataParallel/DDP ("module."), torch.compile ("_orig_mod.").
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or that does not fit the config. It names each tensor
    as the user's file does ('module.Wq.weight'), not by the name we map it to."""


_OUR_TO_SEED = {ours: seed for seed, ours in _SEED_NAMES.items()}


class StateDict(dict):
    """Tensors under our names (to_q.weight ...), remembering each one's key in the user's file,
    so that errors name what the user sees."""

    def __init__(self, tensors: dict[str, Tensor], user_names: dict[str, str], prefix: str = "",
                 seed_names: bool = False) -> None:
        super().__init__(tensors)
        self.user_names = user_names  # ours -> the file's
        self.prefix = prefix  # the wrapper prefix its keys carry ("module.")
        self.seed_names = seed_names  # the file uses the seed's Wq/Wk/Wv/Wo

    def user_name(self, name: str) -> str:
        """`name` (ours) as the file names it; a tensor it lacks, as it would name it."""
        if name in self.user_names:
            return self.user_names[name]
        module, _, param = name.rpartition(".")
        return f"{self.prefix}{_OUR_TO_SEED.get(module, module) if self.seed_names else module}.{param}"


def user_name(state_dict: dict[str, Tensor], name: str) -> str:
    return state_dict.user_name(name) if isinstance(state_dict, StateDict) else name


def load_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], AttentionConfig | None]:
    """Read a checkpoint file; return (state_dict with our names, the config it carries or None)."""
    path = Path(path)
    try:  # a FIFO or a device would block or never end
        check_regular(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} does not exist") from None
    except (FileRefused, OSError) as err:
        raise CheckpointError(f"checkpoint {path}: {err}") from None
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
                metadata = f.metadata() or {}
        except SafetensorError as err:  # not a safetensors file, or a truncated one
            raise CheckpointError(f"checkpoint {path} could not be read: {err}") from None
        config = AttentionConfig.from_dict(json.loads(metadata["config"])) if "config" in metadata else None
        return canonical_state_dict(tensors), config
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a file that is not a checkpoint
        raise CheckpointError(f"checkpoint {path} could not be read: {err}") from None
    config = None
    if isinstance(loaded, dict) and loaded.get("format") == FORMAT:
        config = AttentionConfig.from_dict(loaded["config"])
        loaded = loaded["state_dict"]
    elif isinstance(loaded, dict):
        for wrapper_key in ("state_dict", "model"):  # common training-loop wrappers
            if isinstance(loaded.get(wrapper_key), dict):
                loaded = loaded[wrapper_key]
                break
    if not isinstance(loaded, dict) or not all(isinstance(v, Tensor) for v in loaded.values()):
        raise CheckpointError(f"checkpoint {path} holds no state_dict of tensors")
    return canonical_state_dict(loaded), config


def canonical_state_dict(state_dict: dict[str, Tensor]) -> StateDict:
    """Rename seed and wrapper keys to ours: 'module.Wq.weight' -> 'to_q.weight' (the original
    names kept, for errors)."""
    renamed: dict[str, Tensor] = {}
    user_names: dict[str, str] = {}
    prefix, seed_names = "", False
    for original, tensor in state_dict.items():
        name = original
        for wrapper in _WRAPPER_PREFIXES:
            if name.startswith(wrapper):
                name = name[len(wrapper):]
                prefix = prefix or original[: len(original) - len(name)]
        module, _, param = name.rpartition(".")
        seed_names = seed_names or module in _SEED_NAMES
        module = _SEED_NAMES.get(module, module)
        if module == "to_out.0":  # diffusers keeps to_out as [Linear, Dropout]
            module = "to_out"
        name = f"{module}.{param}"
        if name in renamed:
            raise CheckpointError(f"checkpoint has two tensors for {name!r}: {user_names[name]!r} and {original!r}")
        renamed[name] = tensor
        user_names[name] = original
    unknown = sorted(user_names[k] for k in renamed if k.rpartition(".")[0] not in PROJECTIONS)
    if unknown:
        raise CheckpointError(
            f"checkpoint has tensors no attention projection uses: {unknown}; "
            f"expected {'/'.join(PROJECTIONS)} (or the seed's Wq/Wk/Wv/Wo) weights and biases"
        )
    return StateDict(renamed, user_names, prefix, seed_names)


def infer_config(state_dict: dict[str, Tensor], num_heads: int, **overrides: Any) -> AttentionConfig:
    """Dims from the projection weights' shapes; num_heads cannot be read from them."""
    for name in (f"{p}.weight" for p in PROJECTIONS):
        if name not in state_dict:
            raise CheckpointError(f"checkpoint lacks tensor {user_name(state_dict, name)!r}")
        if state_dict[name].dim() != 2:
            raise CheckpointError(
                f"tensor {user_name(state_dict, name)!r}: expected a 2-D weight, got shape "
                f"{tuple(state_dict[name].shape)}"
            )
    d_model, query_dim = state_dict["to_q.weight"].shape
    dims = dict(
        query_dim=int(query_dim),
        num_heads=num_heads,
        d_model=int(d_model),
        kv_dim=int(state_dict["to_k.weight"].shape[1]),
        out_dim=int(state_dict["to_out.weight"].shape[0]),
        bias="to_q.bias" in state_dict,
    )
    return AttentionConfig(**(dims | overrides))


def expected_shapes(config: AttentionConfig) -> dict[str, tuple[int, ...]]:
    shapes = {
        "to_q.weight": (config.d_model, config.query_dim),
        "to_k.weight": (config.d_model, config.kv_dim),
        "to_v.weight": (config.d_model, config.kv_dim),
        "to_out.weight": (config.out_dim, config.d_model),
    }
    if config.bias:
        shapes |= {"to_q.bias": (config.d_model,), "to_k.bias": (config.d_model,),
                   "to_v.bias": (config.d_model,), "to_out.bias": (config.out_dim,)}
    return shapes


def check_fits(state_dict: dict[str, Tensor], config: AttentionConfig) -> None:
    """Refuse a checkpoint that does not fit, naming the tensor and both shapes."""
    expected = expected_shapes(config)
    for name, shape in expected.items():
        if name not in state_dict:
            raise CheckpointError(f"checkpoint lacks tensor {user_name(state_dict, name)!r} (expected shape {shape})")
        got = tuple(state_dict[name].shape)
        if got != shape:
            raise CheckpointError(f"tensor {user_name(state_dict, name)!r}: checkpoint has shape {got}, "
                                  f"config expects {shape}")
    extra = sorted(user_name(state_dict, k) for k in set(state_dict) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint has tensors the config has no place for: {extra} (bias={config.bias})")


def build_module(config: AttentionConfig, state_dict: dict[str, Tensor]) -> MultiHeadAttention:
    check_fits(state_dict, config)
    module = MultiHeadAttention(config)
    module.load_state_dict({k: v.to(torch.float32) for k, v in state_dict.items()}, strict=True)
    return module.eval()


def demo_module(config: AttentionConfig, seed: int) -> MultiHeadAttention:
    """Deterministic weights for a demo model: nn.Linear's own init under a fixed seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = MultiHeadAttention(config)
    return module.eval()


def save_checkpoint(module: MultiHeadAttention, path: str | Path) -> None:
    """Our own format: the state_dict and the config, so dims need no flags when loaded."""
    path = Path(path)
    state_dict = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state_dict, str(path), metadata={"config": json.dumps(module.config.to_dict())})
    else:
        torch.save({"format": FORMAT, "config": module.config.to_dict(), "state_dict": state_dict}, path)


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
