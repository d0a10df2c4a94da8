"""The ONNX export: repository layout, config.json, symbolic dims, ORT parity, versions, atomicity.

Uses conftest's session-scoped `model_repository` (both presets exported once, demo weights seed 0)
and `eager_modules`; tests that write to a repository work on a private copy of it.
"""

from __future__ import annotations

import hashlib
import json

import onnx
import pytest
import torch
from attnserve.export import onnx_export
from attnserve.export.__main__ import main as export_main
from attnserve.export.checkpoint import demo_module
from attnserve.export.config import PRESETS, AttentionConfig
from attnserve.export.onnx_export import ExportError, export_model
from attnserve.server import repository

from tests.export_helpers import (
    copy_model,
    finish_export,
    max_abs,
    ort_run,
    ort_session,
    random_mask,
    random_qkv,
    snapshot,
    start_export,
)
from tests.seed_reference import Seed000MultiHeadAttention, Seed002Multiheadattention, trained_like_

pytestmark = pytest.mark.e2e  # exports models (torch tracing, ONNX Runtime parity)

PRESET_NAMES = ("self_attention", "cross_attention")
TOLERANCE = 1e-5
# (batch, lq, lk), none of them among the export's own parity shapes (batch 1/7 x lq 1/300 x lk 1/77),
# nor its trace example: odd sizes, lq > lk and lq < lk, one-token streams.
SHAPES = [(3, 17, 5), (1, 1, 1), (2, 4, 129), (5, 2, 1), (4, 64, 33)]
DEMO_WEIGHTS = {"source": "demo", "seed": 0}


@pytest.fixture(scope="module")
def sessions(model_repository):
    """ORT sessions on the written graphs, by (model name, graph kind)."""
    return {(name, kind): ort_session(model_repository / name / "1" / file)
            for name in PRESET_NAMES
            for kind, file in (("all_outputs", "model.onnx"), ("output_only", "model_output_only.onnx"))}


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_repository_layout(model_repository, name):
    model_dir = model_repository / name
    assert set(snapshot(model_dir)) == {
        "config.json", "1", "1/model.onnx", "1/model_output_only.onnx", "1/model_fused.onnx",
        "1/model_fused_key_padding.onnx", "1/model_head_mask.onnx", "1/model_head_mask_output_only.onnx",
        "1/model_rows_kv.onnx", "1/model_fused_rows.onnx", "1/model_fused_rows_key_padding.onnx",
        "1/export.json",
    }  # so no *.onnx.data, no leftover temporary directory or file
    assert repository.versions(model_dir) == [1]
    for graph in ("model.onnx", "model_output_only.onnx", "model_fused.onnx", "model_fused_key_padding.onnx",
                  "model_head_mask.onnx", "model_head_mask_output_only.onnx", "model_rows_kv.onnx",
                  "model_fused_rows.onnx", "model_fused_rows_key_padding.onnx"):
        model = onnx.load(str(model_dir / "1" / graph), load_external_data=False)
        assert model.graph.initializer, "the weights should be in the graph"
        assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    for graph in ("model_head_mask.onnx", "model_head_mask_output_only.onnx"):
        inputs = onnx.load(str(model_dir / "1" / graph), load_external_data=False).graph.input
        (head_mask,) = [i for i in inputs if i.name == "head_mask"]
        dims = head_mask.type.tensor_type.shape.dim  # (batch, heads, q_len, k_len): heads fixed
        assert [bool(d.dim_param) for d in dims] == [True, False, True, True]
        assert dims[1].dim_value == PRESETS[name].num_heads


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_config_json(model_repository, name):
    cfg = PRESETS[name]
    config = json.loads((model_repository / name / "config.json").read_text())
    record = json.loads((model_repository / name / "1" / "export.json").read_text())
    q, kv, out, h = cfg.query_dim, cfg.kv_dim, cfg.out_dim, cfg.num_heads
    assert config["name"] == name
    assert config["platform"] == "onnxruntime_onnx"
    assert config["inputs"] == [
        {"name": "query", "datatype": "FP32", "shape": [-1, -1, q]},
        {"name": "key", "datatype": "FP32", "shape": [-1, -1, kv]},
        {"name": "value", "datatype": "FP32", "shape": [-1, -1, kv]},
        {"name": "mask", "datatype": "BOOL", "shape": [-1, -1, -1], "optional": True},
    ]
    assert config["outputs"] == [
        {"name": "output", "datatype": "FP32", "shape": [-1, -1, out]},
        {"name": "attn_probs", "datatype": "FP32", "shape": [-1, h, -1, -1]},
    ]
    assert config["graphs"] == {"all_outputs": "model.onnx", "output_only": "model_output_only.onnx",
                                "fused": "model_fused.onnx", "fused_key_padding": "model_fused_key_padding.onnx",
                                "head_mask_all_outputs": "model_head_mask.onnx",
                                "head_mask_output_only": "model_head_mask_output_only.onnx"}
    crossover = config["crossover"]
    lengths = crossover["measured_ms"]["lengths"]
    for kind in ("fused", "fused_key_padding"):
        # Measured here, so not a fixed number: a measured length, or twice the longest one.
        assert crossover[kind] in (*lengths, 2 * lengths[-1])
        assert len(crossover["measured_ms"][kind]) == len(lengths)
    assert len(crossover["measured_ms"]["output_only"]) == len(lengths)
    assert AttentionConfig.from_dict(config["attention"]) == cfg
    assert config["attention"]["head_dim"] == cfg.head_dim
    assert config["batching"]["max_batch_size"] >= 1 and config["limits"]["max_q_len"] >= 1

    assert config["last_export"] == record
    assert record["version"] == 1 and record["opset"] == 18
    assert record["weights"]["source"] == "demo"
    parity = record["parity"]
    assert parity["tolerance"] == TOLERANCE
    errors = parity["max_abs_error"]
    assert {kind: set(errs) for kind, errs in errors.items()} == {
        "all_outputs": {"output", "attn_probs"}, "output_only": {"output"},
        "fused": {"output"}, "fused_key_padding": {"output"},
        # The other mask forms (export.head_mask), on the graphs the server feeds them to.
        "all_outputs.forms": {"output", "attn_probs"}, "output_only.forms": {"output"},
        "head_mask_all_outputs.forms": {"output", "attn_probs"}, "head_mask_output_only.forms": {"output"},
        # The row-chunk graphs (export.chunked), run in chunks as the server runs them.
        "fused_rows": {"output"}, "fused_rows_key_padding": {"output"},
    }
    assert all(0.0 <= e <= TOLERANCE for errs in errors.values() for e in errs.values()), errors
    # Unfused: each shape with and without a mask. Fused: each shape plus a long one; the key
    # padding graph with every key kept and with a key mask (the long shape: the key mask only).
    # Mask forms: each shape in three forms, plus a long per-head mask. Row chunks: each shape
    # plus a long one (b, lq, lk, rows per chunk), for each of the two graphs.
    n = len(parity["shapes"])
    assert parity["long_shapes"] == {"fused": [[1, 2048, 2048]], "fused_key_padding": [[2, 2048, 2048]],
                                     "fused_rows": [[1, 2048, 2048, 700]],
                                     "fused_rows_key_padding": [[2, 1024, 1024, 300]],
                                     "head_mask_output_only": [[1, 2048, 2048]]}
    assert parity["cases"] == 2 * n + (n + 1) + (2 * n + 1) + (3 * n + 1) + 2 * (n + 1) and n >= 8
    assert record["crossover"] == config["crossover"]


@pytest.mark.parametrize("graph", ["model.onnx", "model_output_only.onnx"])
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_graph_dims_are_symbolic(model_repository, name, graph):
    cfg = PRESETS[name]
    model = onnx.load(str(model_repository / name / "1" / graph), load_external_data=False)

    def dims(values):
        return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in values}

    want_outputs = {"output": ["batch", "q_len", cfg.out_dim]}
    if graph == "model.onnx":
        want_outputs["attn_probs"] = ["batch", cfg.num_heads, "q_len", "k_len"]
    assert dims(model.graph.input) == {
        "query": ["batch", "q_len", cfg.query_dim],
        "key": ["batch", "k_len", cfg.kv_dim],
        "value": ["batch", "k_len", cfg.kv_dim],
        "mask": ["batch", "q_len", "k_len"],
    }
    assert dims(model.graph.output) == want_outputs
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [
        onnx.TensorProto.FLOAT] * 3 + [onnx.TensorProto.BOOL]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-lq{}-lk{}".format(*s))
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_ort_matches_eager(sessions, eager_modules, name, shape):
    module = eager_modules[name]
    cfg = module.config
    b, lq, lk = shape
    query, key, value = random_qkv(b, lq, lk, cfg.query_dim, cfg.kv_dim, seed=b * 1000 + lq * 10 + lk)
    for mask in (None, random_mask(b, lq, lk, seed=lq + lk)):
        with torch.no_grad():
            want_out, want_probs = module(query, key, value, mask=mask)
        out, probs = ort_run(sessions[name, "all_outputs"], query, key, value, mask)
        (out_only,) = ort_run(sessions[name, "output_only"], query, key, value, mask)
        assert max_abs(out, want_out) <= TOLERANCE
        assert max_abs(probs, want_probs) <= TOLERANCE
        assert max_abs(out_only, want_out) <= TOLERANCE
        if mask is not None and lk > 1:
            live = mask[0].any(dim=-1).numpy()  # item 0's rows that attend to something
            assert probs[0][:, live, lk // 2:].max() == 0.0  # item 0's padding got no weight


def test_second_export_is_version_2_and_versions_are_never_overwritten(model_repository, eager_modules,
                                                                       tmp_path, capsys):
    repo_dir = copy_model(model_repository, "cross_attention", tmp_path)
    model_dir = repo_dir / "cross_attention"
    version_1 = {k: v for k, v in snapshot(model_dir).items() if k.startswith("1")}

    result = export_model(eager_modules["cross_attention"], repo_dir, "cross_attention", DEMO_WEIGHTS)

    assert result.version == 2 and result.model_dir == model_dir
    assert repository.versions(model_dir) == [1, 2]
    after = snapshot(model_dir)
    assert {k: v for k, v in after.items() if k.startswith("1")} == version_1
    assert set(after) - set(version_1) == {
        "config.json", "2", "2/model.onnx", "2/model_output_only.onnx", "2/model_fused.onnx",
        "2/model_fused_key_padding.onnx", "2/model_head_mask.onnx", "2/model_head_mask_output_only.onnx",
        "2/model_rows_kv.onnx", "2/model_fused_rows.onnx", "2/model_fused_rows_key_padding.onnx",
        "2/export.json",
    }
    config = json.loads((model_dir / "config.json").read_text())
    assert config["last_export"]["version"] == 2
    assert config["last_export"] == json.loads((model_dir / "2" / "export.json").read_text())

    # An explicit version that exists is refused, by the API and by the CLI, before any tracing.
    for version in (1, 2):
        with pytest.raises(ExportError, match=f"{model_dir / str(version)} already exists"):
            export_model(eager_modules["cross_attention"], repo_dir, "cross_attention", DEMO_WEIGHTS, version=version)
    with pytest.raises(ExportError, match=r"version must be in 1..9223372036854775807, got 0"):
        export_model(eager_modules["cross_attention"], repo_dir, "cross_attention", DEMO_WEIGHTS, version=0)
    capsys.readouterr()
    assert export_main(["--preset", "cross_attention", "--repository", str(repo_dir), "--version", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"export: error: {model_dir / '1'} already exists; versions are never overwritten"]
    assert snapshot(model_dir) == after


def test_failed_export_leaves_no_trace(model_repository, tmp_path, monkeypatch, capsys):
    """A parity failure (ORT really run, tolerance made impossible) writes nothing at all."""
    repo_dir = copy_model(model_repository, "cross_attention", tmp_path)
    before = snapshot(repo_dir)
    monkeypatch.setattr(onnx_export, "PARITY_TOLERANCE", 0.0)

    status = export_main(["--preset", "cross_attention", "--repository", str(repo_dir)])

    captured = capsys.readouterr()
    assert status == 1, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export: parity check failed: "), captured.err
    assert "nothing was written" in lines[0]
    assert snapshot(repo_dir) == before  # no version 2, no .export-* directory, config.json untouched


def test_export_with_other_dims_is_refused(model_repository, tmp_path):
    repo_dir = copy_model(model_repository, "cross_attention", tmp_path)
    before = snapshot(repo_dir)
    for other in (AttentionConfig(query_dim=16, num_heads=2), PRESETS["cross_attention"].replace(num_heads=4),
                  PRESETS["cross_attention"].replace(out_dim=8)):
        with pytest.raises(ExportError, match="describes a model with other dims") as exc:
            export_model(demo_module(other, seed=0), repo_dir, "cross_attention", DEMO_WEIGHTS)
        assert "--name" in str(exc.value)
    assert snapshot(repo_dir) == before


# --- the seed classes end to end: their state_dicts through `attnserve export`, then ORT -------------

@pytest.fixture(scope="module")
def seed_exports(tmp_path_factory):
    """Each seed class with trained-like weights, saved with torch.save(state_dict) and exported by
    `attnserve export` in a subprocess; the two exports run side by side to save wall time."""
    root = tmp_path_factory.mktemp("seed_exports")
    refs = {
        "self_attention": trained_like_(Seed000MultiHeadAttention(d_model=512, n_heads=8, dropout=0.1), seed=30).eval(),
        "cross_attention": trained_like_(Seed002Multiheadattention(input_dim=32, heads=2, d_model=32), seed=31).eval(),
    }
    procs = {}
    for preset, ref in refs.items():
        checkpoint = root / f"{preset}.pt"
        torch.save(ref.state_dict(), checkpoint)
        procs[preset] = (checkpoint, start_export("--preset", preset, "--checkpoint", str(checkpoint),
                                                  "--repository", str(root / "models")))
    results = {preset: (checkpoint, finish_export(proc)) for preset, (checkpoint, proc) in procs.items()}
    return root / "models", refs, results


def _check_cli_export(repo_dir, preset, checkpoint, result):
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"(model '{preset}', version 1)" in result.stdout
    weights = json.loads((repo_dir / preset / "1" / "export.json").read_text())["weights"]
    assert weights["source"] == "checkpoint"
    assert weights["path"] == str(checkpoint.resolve())
    assert weights["sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    return ort_session(repo_dir / preset / "1" / "model.onnx")


def test_seed000_checkpoint_end_to_end(seed_exports):
    repo_dir, refs, results = seed_exports
    ref = refs["self_attention"]
    session = _check_cli_export(repo_dir, "self_attention", *results["self_attention"])
    for b, lq, lk in ((3, 17, 5), (2, 10, 10)):
        query, key, value = random_qkv(b, lq, lk, 512, 512, seed=lq)
        mask = random_mask(b, lq, lk, seed=lk)
        for ours_mask, seed_mask in ((None, None), (mask, mask[:, None].long())):  # seed 000: 0 = masked
            with torch.no_grad():
                want_out, want_probs = ref(query, key, value, mask=seed_mask)
            out, probs = ort_run(session, query, key, value, ours_mask)
            assert max_abs(out, want_out) <= TOLERANCE
            assert max_abs(probs, want_probs) <= TOLERANCE


def test_seed002_checkpoint_end_to_end(seed_exports):
    repo_dir, refs, results = seed_exports
    ref = refs["cross_attention"]
    session = _check_cli_export(repo_dir, "cross_attention", *results["cross_attention"])
    query, key, value = random_qkv(4, 256, 77, 32, 32, seed=4)  # the seed document's own test
    with torch.no_grad():
        want = ref(query, key, value)
    out, probs = ort_run(session, query, key, value)
    assert max_abs(out, want) <= TOLERANCE
    assert probs.shape == (4, 2, 256, 77)
