"""`attnserve export` as a user runs it: exit status 2 with one line for our errors, and the
parity figures printed on success."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from attnserve.export.attention import MultiHeadAttention
from attnserve.export.checkpoint import save_checkpoint
from attnserve.export.config import AttentionConfig

from tests.export_helpers import (
    assert_one_error_line,
    finish_export,
    max_abs,
    ort_run,
    ort_session,
    random_mask,
    random_qkv,
    run_export,
    start_export,
)
from tests.seed_reference import Seed002Multiheadattention, trained_like_

pytestmark = pytest.mark.e2e  # runs whole exports


def _assert_argparse_error(result, fragment: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("usage: attnserve export")
    assert f"attnserve export: error: {fragment}" in result.stderr


def test_unknown_preset(tmp_path):
    result = run_export("--preset", "nope", "--repository", str(tmp_path))
    _assert_argparse_error(result, "argument --preset: invalid choice: 'nope'")
    assert not any(tmp_path.iterdir())


def test_name_required_without_preset(tmp_path):
    result = run_export("--heads", "2", "--query-dim", "8", "--repository", str(tmp_path))
    _assert_argparse_error(result, "--name is required without --preset")


@pytest.fixture(scope="module")
def seed002_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "seed002.pt"
    torch.save(Seed002Multiheadattention(input_dim=32, heads=2, d_model=32).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def our_errors(tmp_path_factory, seed002_checkpoint):
    """The runs that fail in our own code (each imports torch: seconds), started side by side."""
    root = tmp_path_factory.mktemp("cli_errors")
    garbage = root / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01 this is not a safetensors file")
    repo = str(root / "models")
    os.mkfifo(root / "fifo.pt")  # would block torch.load's open for ever
    (root / "zero.pt").symlink_to("/dev/zero")  # would be read without end
    runs = {
        "fifo": ("--preset", "cross_attention", "--checkpoint", str(root / "fifo.pt"), "--repository", repo),
        "device": ("--preset", "cross_attention", "--checkpoint", str(root / "zero.pt"), "--repository", repo),
        "opset": ("--preset", "cross_attention", "--opset", "99999", "--repository", repo),
        "version": ("--preset", "cross_attention", "--version", str(2**63), "--repository", repo),
        "huge": ("--name", "huge", "--query-dim", str(10**8), "--heads", "1", "--repository", repo),
        "delay": ("--preset", "cross_attention", "--max-queue-delay-ms", "1e300", "--repository", repo),
        "heads": ("--preset", "self_attention", "--heads", "7", "--repository", repo),
        "missing": ("--preset", "cross_attention", "--checkpoint", str(root / "nowhere.pt"), "--repository", repo),
        "misfit": ("--preset", "self_attention", "--checkpoint", str(seed002_checkpoint), "--repository", repo),
        "garbage": ("--preset", "cross_attention", "--checkpoint", str(garbage), "--repository", repo),
        "no_heads": ("--name", "bare", "--checkpoint", str(seed002_checkpoint), "--repository", repo),
    }
    procs = {key: start_export(*args) for key, args in runs.items()}
    results = {key: finish_export(proc) for key, proc in procs.items()}
    assert not (root / "models").exists(), "a failed run wrote into the repository"
    return root, results


def test_heads_not_dividing_d_model(our_errors):
    _, results = our_errors
    assert_one_error_line(results["heads"], "d_model 512 is not divisible by num_heads 7")


def test_missing_checkpoint_file(our_errors):
    root, results = our_errors
    assert_one_error_line(results["missing"], str(root / "nowhere.pt"), "does not exist")


@pytest.mark.parametrize("key", ["fifo", "device"])
def test_checkpoint_that_is_not_a_regular_file(our_errors, key):
    root, results = our_errors
    assert_one_error_line(results[key], str(root / f"{'fifo' if key == 'fifo' else 'zero'}.pt"),
                          "not a regular file (a")


def test_opset_outside_the_proven_range(our_errors):
    _, results = our_errors
    assert_one_error_line(results["opset"], "opset must be in 17..23, got 99999")


def test_version_past_int64(our_errors):
    _, results = our_errors
    assert_one_error_line(results["version"], f"version must be in 1..{2**63 - 1}, got {2**63}")


def test_dims_whose_weights_outgrow_the_machine(our_errors):
    _, results = our_errors
    assert_one_error_line(results["huge"], "bytes of weights, more than this machine's")


def test_serving_defaults_outside_the_servers_range(our_errors):
    _, results = our_errors
    assert_one_error_line(results["delay"], "max_queue_delay_ms must be a number in", "got 1e+300")


def test_checkpoint_that_does_not_fit(our_errors):
    _, results = our_errors
    assert_one_error_line(results["misfit"], "'to_q.weight'", "(32, 32)", "(512, 512)")


def test_checkpoint_that_is_not_one(our_errors):
    root, results = our_errors
    assert_one_error_line(results["garbage"], str(root / "garbage.safetensors"), "could not be read")


def test_bare_state_dict_needs_heads(our_errors, seed002_checkpoint):
    _, results = our_errors
    assert_one_error_line(results["no_heads"], str(seed002_checkpoint), "give --heads or --preset")


def test_success_prints_parity_figures(tmp_path):
    """Our own format carries its dims: no preset, no dim flags, cross-attention with odd widths."""
    config = AttentionConfig(query_dim=8, num_heads=2, d_model=12, kv_dim=10, out_dim=6)
    module = trained_like_(MultiHeadAttention(config), seed=40).eval()
    checkpoint = tmp_path / "tiny.safetensors"
    save_checkpoint(module, checkpoint)

    result = finish_export(start_export("--name", "tiny", "--checkpoint", str(checkpoint),
                                        "--repository", str(tmp_path / "models")))

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert f"wrote {tmp_path / 'models' / 'tiny' / '1'}  (model 'tiny', version 1)" in out
    # 16 cases for the traced graphs, 9 for the fused one, 17 for the key padding one (export.fused),
    # 25 for the other mask forms (export.head_mask: 8 shapes x 3 forms, one long per-head mask),
    # 18 for the two row-chunk graphs (export.chunked).
    assert re.search(r"parity vs eager PyTorch over 85 cases .*\(Lq, Lk\), \(B, 1, Lq, Lk\), \(B, H, Lq, Lk\); "
                     r".*1x2048x2048, .*2x2048x2048\), tolerance 1e-05:", out), out
    figures = {}
    for graph, errors in re.findall(r"^  (\S+)\s+max abs error: (.+)$", out, re.M):
        figures[graph] = {name: float(value) for name, value in (e.split() for e in errors.split(", "))}
    forms = {f"{kind}.forms" for kind in ("all_outputs", "output_only", "head_mask_all_outputs",
                                          "head_mask_output_only")}
    assert set(figures) == {"all_outputs", "output_only", "fused", "fused_key_padding", "fused_rows",
                            "fused_rows_key_padding", *forms}, out
    assert all(set(figures[g]) == {"output"} for g in ("output_only.forms", "head_mask_output_only.forms"))
    assert set(figures["all_outputs"]) == {"output", "attn_probs"}
    assert all(set(figures[g]) == {"output"} for g in ("output_only", "fused", "fused_key_padding", "fused_rows",
                                                      "fused_rows_key_padding"))
    assert re.search(r"^fused graphs run from sqrt\(Lq\*Lk\) >= fused \d+, fused_key_padding \d+ ", out, re.M), out
    assert all(0.0 <= v <= 1e-5 for errs in figures.values() for v in errs.values()), figures

    model_dir = tmp_path / "models" / "tiny"
    written = json.loads((model_dir / "config.json").read_text())
    assert AttentionConfig.from_dict(written["attention"]) == config
    # The printed figures are the recorded ones (rounded for print).
    recorded = written["last_export"]["parity"]["max_abs_error"]
    for graph, errs in figures.items():
        for name, value in errs.items():
            assert value == pytest.approx(recorded[graph][name], rel=0.01, abs=1e-12)
    # And the written graph is the module from the checkpoint.
    query, key, value = random_qkv(3, 17, 5, 8, 10, seed=41)
    mask = random_mask(3, 17, 5, seed=42)
    with torch.no_grad():
        want_out, want_probs = module(query, key, value, mask=mask)
    got_out, got_probs = ort_run(ort_session(model_dir / "1" / "model.onnx"), query, key, value, mask)
    assert max_abs(got_out, want_out) <= 1e-5 and max_abs(got_probs, want_probs) <= 1e-5


def test_dim_flags_on_a_preset_keep_derived_widths_following_query_dim():
    """--query-dim on a preset moves kv/out widths along, unless the preset (or a flag) set them."""
    from attnserve.export.__main__ import _parser, _resolve

    config = _resolve(_parser().parse_args(["--preset", "self_attention", "--query-dim", "64", "--heads", "4"]))[0]
    assert (config.query_dim, config.d_model, config.kv_dim, config.out_dim) == (64, 64, 64, 64)
    config = _resolve(_parser().parse_args(["--preset", "cross_attention", "--query-dim", "64", "--kv-dim", "48"]))[0]
    # seed 002 passes d_model explicitly (32): it stays; the others follow the flags.
    assert (config.query_dim, config.d_model, config.kv_dim, config.out_dim) == (64, 32, 48, 64)
