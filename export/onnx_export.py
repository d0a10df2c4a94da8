"""Trace the attention module to ONNX, prove parity with eager PyTorch, then write atomically.

Nothing reaches the model repository unless ONNX Runtime, run on the graphs as written, matches
eager PyTorch within PARITY_TOLERANCE at shapes unlike the trace's example (so a dynamic dim
silently fixed during tracing is caught) and with masks that include a fully masked row.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from attnserve.export import chunked, fused, head_mask
from attnserve.export.attention import MultiHeadAttention
from attnserve.export.config import AttentionConfig
from torch import Tensor, nn

from attnserve import contract
from attnserve.contract import DYNAMIC_BATCHING, ServingDefaults
from attnserve.files import fsync_dir, read_json, write_json_atomic

logger = logging.getLogger(__name__)
# The exporter warns once per torchvision op it cannot register; we export none of them.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

PARITY_TOLERANCE = 1e-5
# fp16 graphs: ~3 significant digits per value, over sums of up to d_model products.
PARITY_TOLERANCE_FP16 = 2e-3
# The seeds fill masked scores with -1e10, which overflows to -inf in fp16, so a fully masked
# row would become NaN (softmax of all -inf). The most negative finite fp16 keeps every masked
# key at probability 0 beside a real one and a fully masked row uniform, as the seeds' fill does.
FP16_MASK_FILL = float(torch.finfo(torch.float16).min)
PRECISIONS = ("fp32", "fp16")
DEFAULT_OPSET = 18
# The opsets whose export and parity were proven here (torch.onnx's own ceiling is 23).
OPSETS = range(17, 24)
# (batch, lq, lk) at which parity is proven; each runs without a mask and with one.
PARITY_SHAPES = tuple((b, lq, lk) for b in (1, 7) for lq, lk in ((1, 1), (1, 77), (300, 1), (300, 77)))
# Dynamic axes of the inputs, named as the contract names them (batch, q_len, k_len).
_DYNAMIC_AXES = contract.dynamic_axes(contract.INPUT_NAMES)


class ExportError(RuntimeError):
    """The export cannot go on (a conflict in the repository, a graph that lost a dynamic dim)."""


class ParityError(ExportError):
    """ONNX Runtime and eager PyTorch disagree beyond the tolerance: nothing was written."""


@dataclass
class ExportResult:
    name: str
    version: int
    model_dir: Path
    parity: dict[str, Any] = field(default_factory=dict)
    crossover: dict[str, Any] | None = None


class _Graph(nn.Module):
    """The served signature: (query, key, value, mask (b, lq, lk) bool) -> output[, attn_probs];
    the head-mask graphs' mask is (b, h, lq, lk) bool, named contract.HEAD_MASK.

    Tensors cross the graph's edge in fp32 whatever its precision: an fp16 graph casts inside
    (on a GPU the casts are noise), so clients and the server see one contract."""

    def __init__(self, attention: MultiHeadAttention, with_probs: bool, precision: str = "fp32") -> None:
        super().__init__()
        if precision == "fp16":
            attention = half_precision(attention)
        self.attention = attention
        self.with_probs = with_probs
        self.half = precision == "fp16"

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor):
        if self.half:
            query, key, value = query.half(), key.half(), value.half()
        output, attn_probs = self.attention(query, key, value, mask=mask)
        if self.half:
            output, attn_probs = output.float(), attn_probs.float()
        return (output, attn_probs) if self.with_probs else output


def half_precision(module: MultiHeadAttention) -> MultiHeadAttention:
    """An fp16 copy of `module` whose mask fill stays finite in fp16 (FP16_MASK_FILL)."""
    config = dataclasses.replace(module.config, mask_fill=max(module.config.mask_fill, FP16_MASK_FILL))
    half = MultiHeadAttention(config)
    half.load_state_dict(module.state_dict())
    return half.half().eval()


def _example_sizes(config: AttentionConfig) -> tuple[int, int, int]:
    """Distinct sizes >= 2 for batch, lq, lk, equal to no static dim: a dynamic dim whose
    example equals another dim can be specialised to that constant without a warning."""
    taken = {1, config.query_dim, config.kv_dim, config.out_dim, config.d_model,
             config.num_heads, config.head_dim}
    sizes: list[int] = []
    candidate = 3
    while len(sizes) < 3:
        if candidate not in taken:
            sizes.append(candidate)
            taken.add(candidate)
        candidate += 1
    return sizes[0], sizes[1], sizes[2]


def _random_inputs(config: AttentionConfig, b: int, lq: int, lk: int, generator: torch.Generator):
    query = torch.randn(b, lq, config.query_dim, generator=generator)
    key = torch.randn(b, lk, config.kv_dim, generator=generator)
    value = torch.randn(b, lk, config.kv_dim, generator=generator)
    return query, key, value


def _random_mask(b: int, lq: int, lk: int, generator: torch.Generator) -> Tensor:
    """About a third masked; the first query row of item 0 fully masked."""
    mask = torch.rand(b, lq, lk, generator=generator) > 0.33
    mask[0, 0, :] = False
    return mask


def trace(module: MultiHeadAttention, path: Path, with_probs: bool, opset: int, precision: str = "fp32",
          heads_in_mask: bool = False) -> None:
    """Trace the unfused graph (contract.ALL_OUTPUTS or OUTPUT_ONLY, as `with_probs` says) or,
    `heads_in_mask`, its head-mask twin, whose mask is (b, h, lq, lk) (contract.HEAD_MASK_KINDS)."""
    config = module.config
    b, lq, lk = _example_sizes(config)
    generator = torch.Generator().manual_seed(0)
    query, key, value = _random_inputs(config, b, lq, lk, generator)
    mask_shape = (b, config.num_heads, lq, lk) if heads_in_mask else (b, lq, lk)
    mask = torch.ones(*mask_shape, dtype=torch.bool)
    dims = {n: torch.export.Dim(n) for n in (contract.BATCH, contract.Q_LEN, contract.K_LEN)}
    axes = dict(_DYNAMIC_AXES)
    if heads_in_mask:  # the graph's `head_mask`, (batch, heads, q_len, k_len): heads fixed
        axes["mask"] = {i: d for i, d in enumerate(contract.HEAD_MASK_SHAPE) if d in dims}
    dynamic_shapes = {name: {axis: dims[d] for axis, d in ax.items()} for name, ax in axes.items()}
    output_names = list(contract.OUTPUT_NAMES) if with_probs else ["output"]
    if heads_in_mask:
        kind = contract.HEAD_MASK_ALL_OUTPUTS if with_probs else contract.HEAD_MASK_OUTPUT_ONLY
    else:
        kind = contract.ALL_OUTPUTS if with_probs else contract.OUTPUT_ONLY
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's own deprecation chatter
        torch.onnx.export(
            _Graph(module, with_probs, precision).eval(),
            (query, key, value, mask),
            str(path),
            dynamo=True,
            external_data=False,  # one self-contained file per graph, no model.onnx.data
            input_names=list(contract.GRAPH_INPUTS[kind]),
            output_names=output_names,
            dynamic_shapes=dynamic_shapes,
            opset_version=opset,
            verbose=False,
        )
    _check_graph_signature(path, config, kind=kind)


def _check_graph_signature(path: Path, config: AttentionConfig, with_probs: bool = False,
                           kind: str | None = None) -> None:
    """Every batch/length dim must be symbolic, every width the config's. `kind` names the
    graph (contract.GRAPH_INPUTS/GRAPH_OUTPUTS); without it, the traced graph `with_probs` says."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    widths = {"query_dim": config.query_dim, "kv_dim": config.kv_dim, "out_dim": config.out_dim,
              "num_heads": config.num_heads}
    # The contract's symbolic shapes with this model's widths: a str is a dynamic dim, an int fixed.
    shapes = contract.SYMBOLIC_SHAPES | {contract.KEY_PADDING_MASK: contract.KEY_PADDING_SHAPE,
                                         contract.HEAD_MASK: contract.HEAD_MASK_SHAPE}
    expected = {name: tuple(widths.get(d, d) for d in dims) for name, dims in shapes.items()}
    values = list(graph.input) + list(graph.output)
    names = [v.name for v in values]
    if kind is None:
        kind = contract.ALL_OUTPUTS if with_probs else contract.OUTPUT_ONLY
    wanted = list(contract.GRAPH_INPUTS[kind]) + list(contract.GRAPH_OUTPUTS[kind])
    if names != wanted:
        raise ExportError(f"{path.name}: expected tensors {wanted}, the graph has {names}")
    for v in values:
        dims = v.type.tensor_type.shape.dim
        if len(dims) != len(expected[v.name]):
            raise ExportError(f"{path.name}: {v.name} has rank {len(dims)}, expected {len(expected[v.name])}")
        for axis, (dim, want) in enumerate(zip(dims, expected[v.name], strict=True)):
            if isinstance(want, str) and not dim.dim_param:
                raise ExportError(
                    f"{path.name}: {v.name} axis {axis} should be dynamic ({want}) "
                    f"but was fixed to {dim.dim_value} during tracing"
                )
            if isinstance(want, int) and dim.dim_value != want:
                raise ExportError(f"{path.name}: {v.name} axis {axis} should be {want}, got {dim}")


def check_parity(module: MultiHeadAttention, graphs: dict[str, Path], tolerance: float = PARITY_TOLERANCE
                 ) -> dict[str, Any]:
    """Run ONNX Runtime on each written graph against eager PyTorch (fp32, the seeds' -1e10
    fill); return the figures. Raises ParityError if any max abs error exceeds `tolerance`.
    The unfused graphs run every case with and without a (b, lq, lk) mask; the fused ones
    (export.fused) the same shapes plus a long sequence, with the inputs they take; the other mask
    forms (export.head_mask) run on the unfused graphs and the head-mask ones, plus a long sequence."""
    import onnxruntime as ort

    config = module.config
    fused_graphs = {kind: p for kind, p in graphs.items() if kind in contract.FUSED_KINDS}
    head_graphs = {kind: p for kind, p in graphs.items() if kind in contract.HEAD_MASK_KINDS}
    form_graphs = {kind: p for kind, p in graphs.items()
                   if kind in (contract.ALL_OUTPUTS, contract.OUTPUT_ONLY)} | head_graphs
    row_graphs = {kind: p for kind, p in graphs.items() if kind in contract.ROW_GRAPH_FILES}
    graphs = {kind: p for kind, p in graphs.items()
              if kind not in (*contract.FUSED_KINDS, *contract.HEAD_MASK_KINDS, *contract.ROW_GRAPH_FILES)}
    sessions = {kind: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for kind, p in graphs.items()}
    worst = {kind: {"output": 0.0, "attn_probs": 0.0} for kind in graphs}
    cases = []
    generator = torch.Generator().manual_seed(1234)
    for b, lq, lk in PARITY_SHAPES:
        query, key, value = _random_inputs(config, b, lq, lk, generator)
        for masked in (False, True):
            mask = _random_mask(b, lq, lk, generator) if masked else None
            with torch.no_grad():
                want_out, want_probs = module(query, key, value, mask=mask)
            feeds = {
                "query": query.numpy(), "key": key.numpy(), "value": value.numpy(),
                "mask": (mask if mask is not None else torch.ones(b, lq, lk, dtype=torch.bool)).numpy(),
            }
            case = {"batch": b, "q_len": lq, "k_len": lk, "mask": masked}
            for kind, session in sessions.items():
                got = session.run(None, feeds)
                err_out = float(np.max(np.abs(got[0] - want_out.numpy())))
                case[f"{kind}.output"] = err_out
                worst[kind]["output"] = max(worst[kind]["output"], err_out)
                if len(got) > 1:
                    err_probs = float(np.max(np.abs(got[1] - want_probs.numpy())))
                    case[f"{kind}.attn_probs"] = err_probs
                    worst[kind]["attn_probs"] = max(worst[kind]["attn_probs"], err_probs)
            cases.append(case)
    for kind in graphs:
        if kind == "output_only":
            del worst[kind]["attn_probs"]
    long_shapes = {}
    if fused_graphs:
        fused_worst, fused_cases = fused.parity(module, fused_graphs, PARITY_SHAPES, _random_inputs, generator)
        worst |= fused_worst
        cases += fused_cases
        long_shapes = {kind: [list(s) for s in fused.LONG_PARITY_SHAPES[kind]] for kind in fused_graphs}
    if row_graphs:
        row_worst, row_cases = chunked.parity(module, row_graphs, PARITY_SHAPES, _random_inputs, generator)
        worst |= row_worst
        cases += row_cases
        long_shapes |= {kind: [list(s) for s in chunked.LONG_PARITY_SHAPES[kind]] for kind in row_worst}
    if head_graphs:
        form_worst, form_cases = head_mask.parity(module, form_graphs, PARITY_SHAPES, _random_inputs, generator)
        worst |= form_worst
        cases += form_cases
        long_shapes[contract.HEAD_MASK_OUTPUT_ONLY] = [list(s) for s in head_mask.LONG_PARITY_SHAPES]
    report = {
        "tolerance": tolerance,
        "max_abs_error": worst,
        "shapes": [list(s) for s in PARITY_SHAPES],
        **({"long_shapes": long_shapes} if long_shapes else {}),
        "cases": len(cases),
        "onnxruntime": ort.__version__,
        "torch": torch.__version__,
    }
    failures = [f"{kind}.{out} {err:.3g}" for kind, errs in worst.items() for out, err in errs.items()
                if not err <= tolerance]  # `not <=` also catches NaN
    if failures:
        raise ParityError(
            f"ONNX Runtime differs from eager PyTorch beyond {tolerance:g}: "
            f"{', '.join(failures)}; nothing was written"
        )
    return report


def next_version(model_dir: Path) -> int:
    taken = [contract.parse_version(p.name) for p in model_dir.iterdir() if p.is_dir()] if model_dir.is_dir() else []
    return max((v for v in taken if v is not None), default=0) + 1


def model_config(name: str, config: AttentionConfig, serving: ServingDefaults,
                 kinds: tuple[str, ...] = (contract.ALL_OUTPUTS, contract.OUTPUT_ONLY),
                 crossover: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json: `kinds` are the graphs a version holds; `crossover` (fused graphs only) the
    lengths from which the fused graphs run (export.fused.measure_crossover)."""
    return {
        "name": name,
        "platform": contract.PLATFORM,
        "attention": config.to_dict(),
        **contract.tensor_contract(config.query_dim, config.kv_dim, config.out_dim, config.num_heads),
        "graphs": {kind: contract.GRAPH_FILES[kind] for kind in kinds},
        **({contract.CROSSOVER: crossover} if crossover else {}),
        "batching": serving.batching(),
        "limits": serving.limits(),
    }


def _same_interface(existing: dict[str, Any], new: dict[str, Any]) -> bool:
    return all(existing.get(k) == new.get(k) for k in ("inputs", "outputs")) and all(
        existing.get("attention", {}).get(k) == new["attention"][k]
        for k in ("query_dim", "kv_dim", "out_dim", "num_heads", "d_model")
    )


def export_model(
    module: MultiHeadAttention,
    repository: Path,
    name: str,
    weights: dict[str, Any],
    version: int | None = None,
    opset: int = DEFAULT_OPSET,
    serving: ServingDefaults = ServingDefaults(),
    precision: str = "fp32",
) -> ExportResult:
    """Trace both graphs into a temporary directory, build the fused ones (export.fused), prove
    parity, measure the fused graphs' crossover, then move it into place.
    precision "fp16": the graphs compute in half precision (for GPUs), parity within
    PARITY_TOLERANCE_FP16 of the fp32 module; their inputs and outputs stay fp32. fp16 versions
    have no fused graphs (ONNX Runtime's CPU MultiHeadAttention, where parity runs, is fp32 only)
    and no head-mask graphs (a mask whose heads differ is refused on them).

    A version directory appears whole (one rename) or not at all; config.json is replaced
    atomically after it. Raises ExportError/ParityError without touching existing versions."""
    if precision not in PRECISIONS:
        raise ExportError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if opset not in OPSETS:
        raise ExportError(f"opset must be in {OPSETS.start}..{OPSETS.stop - 1}, got {opset}")
    module = module.eval()  # dropout off, in the eager reference as in the graph
    config = module.config
    model_dir = Path(repository) / name
    new_config = model_config(name, config, serving)
    config_path = model_dir / contract.CONFIG_FILE
    kept: dict[str, Any] = {}  # what a user put in config.json that outlives exports
    if config_path.exists():
        existing = read_json(config_path)
        for key in ("version_policy", DYNAMIC_BATCHING):  # the versions served; priorities, queue timeout
            if key in existing:
                kept[key] = existing[key]
        if not _same_interface(existing, new_config):
            raise ExportError(
                f"{config_path} describes a model with other dims ({existing.get('attention')}); "
                f"versions of one model share its tensors: export under another --name"
            )
    version = next_version(model_dir) if version is None else version
    if not 1 <= version <= contract.MAX_VERSION:
        raise ExportError(f"version must be in 1..{contract.MAX_VERSION}, got {version}")
    target = model_dir / str(version)
    if target.exists():
        raise ExportError(f"{target} already exists; versions are never overwritten")

    model_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".export-{version}-", dir=model_dir))
    try:
        kinds = (contract.ALL_OUTPUTS, contract.OUTPUT_ONLY) + (
            (*contract.FUSED_KINDS, *contract.HEAD_MASK_KINDS) if precision == "fp32" else ())
        graphs = {kind: staging / contract.GRAPH_FILES[kind] for kind in kinds}
        trace(module, graphs[contract.ALL_OUTPUTS], with_probs=True, opset=opset, precision=precision)
        trace(module, graphs[contract.OUTPUT_ONLY], with_probs=False, opset=opset, precision=precision)
        for kind in (k for k in kinds if k in contract.HEAD_MASK_KINDS):
            trace(module, graphs[kind], with_probs=kind == contract.HEAD_MASK_ALL_OUTPUTS, opset=opset,
                  precision=precision, heads_in_mask=True)
        for kind in kinds:
            if kind in contract.FUSED_KINDS:
                fused.build(module, graphs[kind], kind, opset)
                _check_graph_signature(graphs[kind], config, kind=kind)
        rows_graphs = {kind: staging / file for kind, file in contract.ROW_GRAPH_FILES.items()}
        if precision == "fp32":  # as the fused graphs: ONNX Runtime's CPU MultiHeadAttention is fp32 only
            chunked.build(module, rows_graphs, opset)
            graphs |= rows_graphs
        parity = check_parity(module, graphs,
                              tolerance=PARITY_TOLERANCE_FP16 if precision == "fp16" else PARITY_TOLERANCE)
        crossover = None
        if precision == "fp32":
            crossover = fused.measure_crossover(
                config, graphs[contract.OUTPUT_ONLY], {k: graphs[k] for k in contract.FUSED_KINDS})
        record = {
            "version": version,
            "exported_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "opset": opset,
            "precision": precision,
            # What masked scores are filled with inside the graphs (fp16 keeps it finite).
            "graph_mask_fill": max(config.mask_fill, FP16_MASK_FILL) if precision == "fp16" else config.mask_fill,
            "attention": config.to_dict(),
            "weights": weights,
            "graphs": {kind: contract.GRAPH_FILES[kind] for kind in kinds},
            **({"row_graphs": dict(contract.ROW_GRAPH_FILES)} if precision == "fp32" else {}),
            "parity": parity,
            **({contract.CROSSOVER: crossover} if crossover else {}),
        }
        new_config = model_config(name, config, serving, kinds, crossover) | kept
        write_json_atomic(staging / contract.EXPORT_FILE, record)
        staging.chmod(0o755)  # mkdtemp makes it 0700; servers may run as another user
        staging.rename(target)  # atomic: the version appears whole
        fsync_dir(model_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    write_json_atomic(config_path, new_config | {"last_export": record})
    logger.info("wrote %s (parity %s)", target, parity["max_abs_error"])
    return ExportResult(name=name, version=version, model_dir=model_dir, parity=parity, crossover=crossover)
