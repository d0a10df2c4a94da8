"""Loading weights: both seed classes' state_dicts, wrapper prefixes, our own format, and refusals."""

from __future__ import annotations

import pytest
import torch
from attnserve.export.attention import MultiHeadAttention
from attnserve.export.checkpoint import (
    CheckpointError,
    build_module,
    canonical_state_dict,
    infer_config,
    load_checkpoint,
    save_checkpoint,
)
from attnserve.export.config import PRESETS, AttentionConfig

from tests.seed_reference import Seed000MultiHeadAttention, Seed002Multiheadattention, trained_like_

OUR_NAMES = {f"{p}.{t}" for p in ("to_q", "to_k", "to_v", "to_out") for t in ("weight", "bias")}
SEED000_TO_OURS = {"Wq": "to_q", "Wk": "to_k", "Wv": "to_v", "Wo": "to_out"}


@pytest.fixture(scope="module")
def seed000_ref():
    return trained_like_(Seed000MultiHeadAttention(d_model=512, n_heads=8), seed=20).eval()


@pytest.fixture(scope="module")
def seed002_ref():
    return trained_like_(Seed002Multiheadattention(input_dim=32, heads=2, d_model=32), seed=21).eval()


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_seed000_state_dict_loads_under_our_names(tmp_path, seed000_ref):
    path = tmp_path / "seed000.pt"
    torch.save(seed000_ref.state_dict(), path)
    state_dict, config = load_checkpoint(path)
    assert config is None  # a bare state_dict carries no dims
    want = {f"{SEED000_TO_OURS[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in seed000_ref.state_dict().items()}
    assert set(want) == OUR_NAMES
    _assert_same_tensors(state_dict, want)
    # And it drives the module: same outputs as the seed class it came from.
    ours = build_module(PRESETS["self_attention"], state_dict)
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x, x, x)[0], seed000_ref(x, x, x)[0], atol=1e-6, rtol=0)


def test_seed002_state_dict_loads_unchanged(tmp_path, seed002_ref):
    path = tmp_path / "seed002.pth"
    torch.save(seed002_ref.state_dict(), path)
    state_dict, config = load_checkpoint(path)
    assert config is None
    _assert_same_tensors(state_dict, dict(seed002_ref.state_dict()))
    ours = build_module(PRESETS["cross_attention"], state_dict)
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(2, 256, 32, generator=g), torch.randn(2, 77, 32, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ours(q, kv, kv)[0], seed002_ref(q, kv, kv), atol=1e-6, rtol=0)


@pytest.mark.parametrize("prefix", ["module.", "_orig_mod.", "module._orig_mod."])
def test_wrapper_prefixes_are_stripped(tmp_path, seed000_ref, prefix):
    path = tmp_path / "wrapped.pt"
    torch.save({prefix + k: v for k, v in seed000_ref.state_dict().items()}, path)
    state_dict, _ = load_checkpoint(path)
    assert set(state_dict) == OUR_NAMES
    assert torch.equal(state_dict["to_k.weight"], seed000_ref.Wk.weight)


@pytest.mark.parametrize("wrapper_key", ["state_dict", "model"])
def test_training_loop_wrappers_are_unwrapped(tmp_path, seed002_ref, wrapper_key):
    path = tmp_path / "trainer.pt"
    torch.save({wrapper_key: seed002_ref.state_dict(), "epoch": 7, "lr": 1e-4}, path)
    state_dict, _ = load_checkpoint(path)
    _assert_same_tensors(state_dict, dict(seed002_ref.state_dict()))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_our_format_round_trips_with_its_config(tmp_path, suffix):
    config = AttentionConfig(query_dim=12, num_heads=3, d_model=18, kv_dim=20, out_dim=5, dropout=0.2)
    module = trained_like_(MultiHeadAttention(config), seed=22).eval()
    path = tmp_path / f"ours{suffix}"
    save_checkpoint(module, path)
    state_dict, carried = load_checkpoint(path)
    assert carried == config
    _assert_same_tensors(state_dict, {k: v.detach() for k, v in module.state_dict().items()})
    rebuilt = build_module(carried, state_dict)
    g = torch.Generator().manual_seed(2)
    q, kv = torch.randn(2, 3, 12, generator=g), torch.randn(2, 4, 20, generator=g)
    with torch.no_grad():
        for got, want in zip(rebuilt(q, kv, kv), module(q, kv, kv), strict=True):
            assert torch.equal(got, want)


def test_our_format_without_bias_round_trips(tmp_path):
    config = AttentionConfig(query_dim=8, num_heads=2, bias=False)
    module = trained_like_(MultiHeadAttention(config), seed=23)
    save_checkpoint(module, tmp_path / "nobias.safetensors")
    state_dict, carried = load_checkpoint(tmp_path / "nobias.safetensors")
    assert carried == config and not carried.bias
    assert set(state_dict) == {"to_q.weight", "to_k.weight", "to_v.weight", "to_out.weight"}


def test_infer_config_reads_the_dims(seed002_ref):
    config = infer_config(canonical_state_dict(seed002_ref.state_dict()), num_heads=2)
    assert config == AttentionConfig(query_dim=32, num_heads=2, d_model=32)

    cross = AttentionConfig(query_dim=12, num_heads=3, d_model=18, kv_dim=20, out_dim=5, bias=False)
    got = infer_config(MultiHeadAttention(cross).state_dict(), num_heads=3)
    assert (got.query_dim, got.d_model, got.kv_dim, got.out_dim, got.num_heads, got.bias) == (12, 18, 20, 5, 3, False)
    # Explicit values win over what the shapes say (here: dropout, which shapes cannot tell).
    assert infer_config(MultiHeadAttention(cross).state_dict(), num_heads=3, dropout=0.1).dropout == 0.1


def test_infer_config_refuses_a_missing_projection(seed002_ref):
    state_dict = dict(seed002_ref.state_dict())
    del state_dict["to_v.weight"]
    with pytest.raises(CheckpointError, match=r"lacks tensor 'to_v.weight'"):
        infer_config(state_dict, num_heads=2)


def test_infer_config_refuses_heads_that_do_not_divide(seed002_ref):
    with pytest.raises(ValueError, match="d_model 32 is not divisible by num_heads 5"):
        infer_config(canonical_state_dict(seed002_ref.state_dict()), num_heads=5)


def test_mismatching_checkpoint_names_tensor_and_both_shapes(tmp_path, seed000_ref):
    state_dict = dict(seed000_ref.state_dict())
    state_dict["Wk.weight"] = torch.randn(512, 256)  # a kv width of 256, for a 512 config
    path = tmp_path / "kv256.pt"
    torch.save(state_dict, path)
    loaded, _ = load_checkpoint(path)
    with pytest.raises(CheckpointError) as exc:
        build_module(PRESETS["self_attention"], loaded)
    message = str(exc.value)
    # Named as the user's file names it, not as we map it (to_k.weight).
    assert "'Wk.weight'" in message and "(512, 256)" in message and "(512, 512)" in message
    assert "to_k" not in message


def test_seed002_checkpoint_refused_by_seed000_config(seed002_ref):
    with pytest.raises(CheckpointError,
                       match=r"'to_q.weight': checkpoint has shape \(32, 32\), config expects \(512, 512\)"):
        build_module(PRESETS["self_attention"], dict(seed002_ref.state_dict()))


def test_missing_tensor_refused(seed002_ref):
    state_dict = dict(seed002_ref.state_dict())
    del state_dict["to_out.bias"]
    with pytest.raises(CheckpointError, match=r"lacks tensor 'to_out.bias' \(expected shape \(32,\)\)"):
        build_module(PRESETS["cross_attention"], state_dict)


def test_bias_without_a_place_refused(seed002_ref):
    with pytest.raises(CheckpointError,
                       match=r"no place for: \['to_k.bias', 'to_out.bias', 'to_q.bias', 'to_v.bias'\]"):
        build_module(PRESETS["cross_attention"].replace(bias=False), dict(seed002_ref.state_dict()))


@pytest.mark.parametrize(
    ("extra", "named"),
    [("norm.weight", "norm.weight"), ("encoder.Wq.weight", "encoder.Wq.weight"), ("bias", "bias"),
     ("Wq.scale", "Wq.scale")],  # a projection's module but no such parameter: refused when built
)
def test_unknown_tensors_refused(tmp_path, seed000_ref, extra, named):
    state_dict = dict(seed000_ref.state_dict()) | {extra: torch.zeros(3)}
    path = tmp_path / "extra.pt"
    torch.save(state_dict, path)
    with pytest.raises(CheckpointError) as exc:
        build_module(PRESETS["self_attention"], load_checkpoint(path)[0])
    assert repr(named) in str(exc.value)


def test_a_wrapped_seed_checkpoint_lacking_a_tensor_is_told_in_its_own_names(tmp_path, seed000_ref):
    """A DataParallel-saved seed-000 checkpoint without Wv: the error names 'module.Wv.weight'."""
    state_dict = {f"module.{k}": v for k, v in seed000_ref.state_dict().items() if not k.startswith("Wv.")}
    path = tmp_path / "dp.pt"
    torch.save(state_dict, path)
    loaded, _ = load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"lacks tensor 'module.Wv.weight'"):
        infer_config(loaded, num_heads=8)
    with pytest.raises(CheckpointError, match=r"lacks tensor 'module.Wv.weight' \(expected shape \(512, 512\)\)"):
        build_module(PRESETS["self_attention"], loaded)


def test_two_names_for_one_tensor_refused(seed000_ref):
    state_dict = dict(seed000_ref.state_dict()) | {"to_q.weight": torch.zeros(512, 512)}
    with pytest.raises(CheckpointError, match=r"two tensors for 'to_q.weight'"):
        canonical_state_dict(state_dict)


@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("notes.pt", b"these are not weights\n", "could not be read"),
        ("empty.pth", b"", "could not be read"),
        ("garbage.safetensors", b"\x00\x01not a safetensors header", "could not be read"),
    ],
)
def test_file_that_is_not_a_checkpoint(tmp_path, name, content, fragment):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(path)
    assert fragment in str(exc.value) and name in str(exc.value)


def test_pickle_without_tensors_refused(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match="holds no state_dict of tensors"):
        load_checkpoint(path)


def test_missing_file_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere.pt")
    with pytest.raises(CheckpointError, match="not a regular file \\(a directory\\)"):
        load_checkpoint(tmp_path)  # a directory is not a checkpoint either
