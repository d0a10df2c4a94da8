"""`attnserve export`: write an attention model into the model repository, parity proven first.

    attnserve export --preset self_attention
    attnserve export --preset cross_attention --checkpoint seed002.pt
    attnserve export --name my_attn --heads 4 --checkpoint weights.safetensors
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from attnserve.export.config import PRESET_ARGS, PRESETS, AttentionConfig

DEMO_SEED = 0
EXIT_BAD_ARGUMENTS = 2
EXIT_PARITY = 1


def _parser(prog: str = "attnserve export") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Export multi-head attention to ONNX (dynamic batch, q_len, k_len) into a model "
        "repository, after proving ONNX Runtime matches eager PyTorch within 1e-5.",
    )
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="the reference models' sizes (self_attention: seed 000, cross_attention: seed 002)")
    p.add_argument("--name", help="model name (default: the preset)")
    p.add_argument("--repository", type=Path, default=Path("models"), help="model repository (default: models)")
    p.add_argument("--version", type=int, help="version number (default: the next one)")
    p.add_argument("--checkpoint", type=Path,
                   help="state_dict (.pt/.pth, either seed class or ours) or .safetensors; "
                        f"without one, deterministic demo weights (seed {DEMO_SEED})")
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default: 18)")
    p.add_argument("--precision", choices=("fp32", "fp16"), default="fp32",
                   help="arithmetic inside the graphs; fp16 is for GPUs (inputs and outputs stay fp32)")
    dims = p.add_argument_group("dims (override the preset; read from --checkpoint when omitted)")
    dims.add_argument("--query-dim", type=int, help="query width (seed 000 d_model, seed 002 input_dim)")
    dims.add_argument("--kv-dim", type=int, help="key/value width (default: query width)")
    dims.add_argument("--d-model", type=int, help="projected width = heads x head_dim (default: query width)")
    dims.add_argument("--out-dim", type=int, help="output width (default: query width)")
    dims.add_argument("--heads", type=int, help="number of heads")
    dims.add_argument("--no-bias", action="store_true", help="projections without bias")
    serving = p.add_argument_group("serving defaults written to config.json")
    serving.add_argument("--max-batch-size", type=int, help="sequences per ONNX Runtime run (default 32)")
    serving.add_argument("--max-queue-delay-ms", type=float, help="batching wait while busy (default 1.0)")
    serving.add_argument("--max-q-len", type=int, help="longest query accepted (default 8192)")
    serving.add_argument("--max-kv-len", type=int, help="longest key/value accepted (default 8192)")
    return p


def _dim_overrides(args: argparse.Namespace) -> dict:
    overrides = {
        "query_dim": args.query_dim, "kv_dim": args.kv_dim, "d_model": args.d_model,
        "out_dim": args.out_dim, "num_heads": args.heads,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.no_bias:
        overrides["bias"] = False
    return overrides


def _check_fits_in_memory(config: AttentionConfig) -> None:
    """Refuse dims whose weights alone outgrow this machine's memory (tracing and parity need a
    few times more), before torch is asked for them."""
    try:
        machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if config.weight_bytes > machine:
        raise ValueError(f"dims {config.query_dim}/{config.kv_dim}/{config.d_model}/{config.out_dim} "
                         f"(query/kv/d_model/out) need {config.weight_bytes:,} bytes of weights, more than this "
                         f"machine's {machine:,}")


def _resolve(args: argparse.Namespace):
    """(config, module, weights' source) from the preset, the dim flags and the checkpoint."""
    from attnserve.export import checkpoint as ckpt

    overrides = _dim_overrides(args)
    preset = PRESET_ARGS[args.preset] if args.preset else None
    if args.checkpoint is None:
        if preset is None and "query_dim" not in overrides:
            raise ValueError("give --preset, or --query-dim and --heads, or --checkpoint")
        if preset is None and "num_heads" not in overrides:
            raise ValueError("--heads is required without --preset")
        config = AttentionConfig(**((preset or {}) | overrides))
        _check_fits_in_memory(config)
        return config, ckpt.demo_module(config, DEMO_SEED), {"source": "demo", "seed": DEMO_SEED,
                                                             "note": "deterministic demo weights, not trained"}
    state_dict, carried = ckpt.load_checkpoint(args.checkpoint)
    if preset is not None:
        config = AttentionConfig(**(preset | overrides))
    elif carried is not None:
        config = carried.replace(**overrides)
    else:
        if "num_heads" not in overrides:
            raise ValueError(f"{args.checkpoint} does not say how many heads it has: give --heads or --preset")
        config = ckpt.infer_config(state_dict, **overrides)
    _check_fits_in_memory(config)
    module = ckpt.build_module(config, state_dict)
    weights = {"source": "checkpoint", "path": str(args.checkpoint.resolve()),
               "sha256": ckpt.file_sha256(args.checkpoint)}
    return config, module, weights


def _print_report(result) -> None:
    parity = result.parity
    print(f"wrote {result.model_dir / str(result.version)}  (model {result.name!r}, version {result.version})")
    long_shapes = parity.get("long_shapes", {})
    shapes = sorted({"x".join(map(str, s)) for v in long_shapes.values() for s in v})
    longest = "; fused and head-mask graphs also at " + ", ".join(shapes) if long_shapes else ""
    with_forms = any(k.endswith(".forms") for k in parity["max_abs_error"])
    forms = "; masks (Lq, Lk), (B, 1, Lq, Lk), (B, H, Lq, Lk)" if with_forms else ""
    print(f"parity vs eager PyTorch over {parity['cases']} cases "
          f"(batch 1/7, q_len 1/300, k_len 1/77, with and without mask{forms}{longest}), "
          f"tolerance {parity['tolerance']:g}:")
    width = max(map(len, parity["max_abs_error"]), default=0)
    for graph, errors in parity["max_abs_error"].items():
        figures = ", ".join(f"{out} {err:.2e}" for out, err in errors.items())
        print(f"  {graph:<{width}} max abs error: {figures}")
    crossover = result.crossover
    if crossover:
        print("fused graphs run from sqrt(Lq*Lk) >= " + ", ".join(
            f"{kind} {crossover[kind]}" for kind in ("fused", "fused_key_padding") if kind in crossover)
            + " (measured here; config.json \"crossover\")")


def main(argv: list[str] | None = None, prog: str = "attnserve export") -> int:
    parser = _parser(prog)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    name = args.name or args.preset
    if name is None:
        parser.error("--name is required without --preset")
    if not name.replace("_", "").replace("-", "").replace(".", "").isalnum():
        parser.error(f"--name {name!r}: use letters, digits, '_', '-' and '.'")
    try:
        from attnserve.export.checkpoint import CheckpointError
        from attnserve.export.onnx_export import DEFAULT_OPSET, ExportError, ParityError, ServingDefaults, export_model

        serving = ServingDefaults(**{k: v for k, v in (
            ("max_batch_size", args.max_batch_size), ("max_queue_delay_ms", args.max_queue_delay_ms),
            ("max_q_len", args.max_q_len), ("max_kv_len", args.max_kv_len)) if v is not None})
        _config, module, weights = _resolve(args)
        result = export_model(module, args.repository, name, weights, version=args.version,
                              opset=args.opset or DEFAULT_OPSET, serving=serving, precision=args.precision)
    except ParityError as err:
        print(f"export: parity check failed: {err}", file=sys.stderr)
        return EXIT_PARITY
    except (ValueError, CheckpointError, ExportError, OSError) as err:
        print(f"export: error: {err}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    _print_report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
