"""Our MultiHeadAttention against re-implementations of the two seed modules, loaded with their weights."""

from __future__ import annotations

import math

import pytest
import torch
from attnserve.export.attention import MultiHeadAttention
from attnserve.export.checkpoint import build_module, canonical_state_dict
from attnserve.export.config import PRESETS, AttentionConfig

from tests.seed_reference import Seed000MultiHeadAttention, Seed002Multiheadattention, trained_like_

# The seeds' own arithmetic is reproduced op for op, so anything above float32 noise is a defect.
EXACT = dict(atol=1e-6, rtol=0.0)
B, LQ, LK = 2, 7, 9  # lq != lk so a transposed mask or swapped length cannot pass


@pytest.fixture(scope="module")
def seed000():
    """(seed reference, ours) with the same trained-like weights, both in eval mode."""
    torch.manual_seed(0)
    ref = trained_like_(Seed000MultiHeadAttention(d_model=512, n_heads=8, dropout=0.1), seed=1).eval()
    ours = build_module(AttentionConfig(query_dim=512, num_heads=8, dropout=0.1),
                        canonical_state_dict(ref.state_dict()))
    return ref, ours


@pytest.fixture(scope="module")
def qkv000():
    g = torch.Generator().manual_seed(2)
    return (torch.randn(B, LQ, 512, generator=g), torch.randn(B, LK, 512, generator=g),
            torch.randn(B, LK, 512, generator=g))


def _mask_with_dead_row(shape: tuple[int, ...], seed: int, dtype=torch.int64) -> torch.Tensor:
    """0/1 mask (seed 000 uses `mask == 0`), about a third masked, the first query row fully masked."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(shape, generator=g) > 0.33).to(dtype)
    if len(shape) >= 2 and shape[-2] > 1:
        mask[(0,) * (len(shape) - 2) + (0,)] = 0  # every key of query row 0 (of item 0, head 0)
    return mask


def test_seed000_preset_is_the_seed_default():
    assert PRESETS["self_attention"] == AttentionConfig(query_dim=512, num_heads=8, dropout=0.1)


def test_seed000_outputs_and_probs_match_without_mask(seed000, qkv000):
    ref, ours = seed000
    with torch.no_grad():
        want_out, want_probs = ref(*qkv000)
        got_out, got_probs = ours(*qkv000)
    assert got_out.shape == (B, LQ, 512) and got_probs.shape == (B, 8, LQ, LK)
    torch.testing.assert_close(got_out, want_out, **EXACT)
    torch.testing.assert_close(got_probs, want_probs, **EXACT)


# Each case: the mask we are given, and the same mask as seed 000 would need it to broadcast
# against its (b, h, lq, lk) scores. A 3-D mask is (b, lq, lk) for us; seed 000 would align it
# from the right, so the reference gets it with the head axis inserted.
MASK_CASES = {
    "lq_lk": ((LQ, LK), lambda m: m),
    "b_lq_lk": ((B, LQ, LK), lambda m: m[:, None]),
    "b_h_lq_lk": ((B, 8, LQ, LK), lambda m: m),
    "b_1_1_lk_padding": ((B, 1, 1, LK), lambda m: m),
    "1_h_lq_lk": ((1, 8, LQ, LK), lambda m: m),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=["int", "bool"])
@pytest.mark.parametrize("case", sorted(MASK_CASES))
def test_seed000_masks_match(seed000, qkv000, case, dtype):
    ref, ours = seed000
    shape, as_seed = MASK_CASES[case]
    mask = _mask_with_dead_row(shape, seed=len(case), dtype=dtype)
    if case == "b_1_1_lk_padding":
        mask[1, 0, 0, -3:] = 0  # item 1 padded to lk - 3 keys
    with torch.no_grad():
        want_out, want_probs = ref(*qkv000, mask=as_seed(mask))
        got_out, got_probs = ours(*qkv000, mask=mask)
    torch.testing.assert_close(got_out, want_out, **EXACT)
    torch.testing.assert_close(got_probs, want_probs, **EXACT)
    # The mask took effect: masked keys get (numerically) zero weight outside fully masked rows.
    keep = as_seed(mask).bool().expand(B, 8, LQ, LK)
    live_rows = keep.any(dim=-1, keepdim=True).expand_as(keep)
    assert got_probs[~keep & live_rows].abs().max() == 0.0


def test_key_mask_is_a_padding_mask(seed000, qkv000):
    ref, ours = seed000
    key_mask = torch.ones(B, LK, dtype=torch.bool)
    key_mask[0, 5:] = False
    key_mask[1, 2:] = False
    with torch.no_grad():
        want_out, want_probs = ref(*qkv000, mask=key_mask[:, None, None, :])
        got_out, got_probs = ours(*qkv000, key_mask=key_mask)
    torch.testing.assert_close(got_out, want_out, **EXACT)
    torch.testing.assert_close(got_probs, want_probs, **EXACT)
    assert got_probs[1, :, :, 2:].abs().max() == 0.0


def test_mask_and_key_mask_combine(seed000, qkv000):
    ref, ours = seed000
    mask = _mask_with_dead_row((B, LQ, LK), seed=5)
    key_mask = torch.ones(B, LK, dtype=torch.bool)
    key_mask[1, -4:] = False
    with torch.no_grad():
        want_out, want_probs = ref(*qkv000, mask=mask[:, None] * key_mask[:, None, None, :])
        got_out, got_probs = ours(*qkv000, mask=mask, key_mask=key_mask)
    torch.testing.assert_close(got_out, want_out, **EXACT)
    torch.testing.assert_close(got_probs, want_probs, **EXACT)


def test_fully_masked_row_is_uniform_not_nan(seed000, qkv000):
    _, ours = seed000
    mask = torch.ones(B, LQ, LK, dtype=torch.bool)
    mask[1, 3, :] = False
    with torch.no_grad():
        out, probs = ours(*qkv000, mask=mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(probs[1, :, 3], torch.full((8, LK), 1.0 / LK), **EXACT)
    # Rows that attend are not uniform (the weights are trained-like), so the check above means something.
    assert (probs[1, :, 2] - 1.0 / LK).abs().max() > 1e-2


def test_seed002_cross_attention_matches():
    torch.manual_seed(0)
    ref = trained_like_(Seed002Multiheadattention(input_dim=32, heads=2, d_model=32), seed=3).eval()
    config = AttentionConfig(query_dim=32, num_heads=2, d_model=32)
    assert PRESETS["cross_attention"] == config
    ours = build_module(config, canonical_state_dict(ref.state_dict()))
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(4, 256, 32, generator=g), torch.randn(4, 77, 32, generator=g),
               torch.randn(4, 77, 32, generator=g))
    with torch.no_grad():
        want = ref(q, k, v)
        got_out, got_probs = ours(q, k, v)
    assert got_out.shape == (4, 256, 32) and got_probs.shape == (4, 2, 256, 77)
    torch.testing.assert_close(got_out, want, **EXACT)
    torch.testing.assert_close(got_probs.sum(-1), torch.ones(4, 2, 256), atol=1e-5, rtol=0)


def test_seed002_with_d_model_unlike_input_dim():
    """Seed 002 projects input_dim 24 up to d_model 32 over 4 heads and back to 24."""
    ref = trained_like_(Seed002Multiheadattention(input_dim=24, heads=4, d_model=32), seed=6).eval()
    ours = build_module(AttentionConfig(query_dim=24, num_heads=4, d_model=32), canonical_state_dict(ref.state_dict()))
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 11, 24, generator=g)
    k, v = torch.randn(3, 5, 24, generator=g), torch.randn(3, 5, 24, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(ours(q, k, v)[0], ref(q, k, v), **EXACT)


def _einsum_reference(module: MultiHeadAttention, query, key, value):
    """Attention written independently (einsum, no view/transpose) from the module's weights."""
    cfg = module.config
    h, dh = cfg.num_heads, cfg.head_dim

    def project(linear, x):
        return torch.nn.functional.linear(x, linear.weight, linear.bias)

    q = project(module.to_q, query).unflatten(-1, (h, dh))  # (b, lq, h, dh)
    k = project(module.to_k, key).unflatten(-1, (h, dh))
    v = project(module.to_v, value).unflatten(-1, (h, dh))
    probs = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh), dim=-1)
    merged = torch.einsum("bhqk,bkhd->bqhd", probs, v).flatten(-2)
    return project(module.to_out, merged), probs


@pytest.mark.parametrize("bias", [True, False])
def test_kv_dim_and_out_dim_unlike_query_dim(bias):
    config = AttentionConfig(query_dim=12, num_heads=3, d_model=18, kv_dim=20, out_dim=5, bias=bias)
    module = trained_like_(MultiHeadAttention(config), seed=8).eval()
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(2, 6, 12, generator=g), torch.randn(2, 4, 20, generator=g), torch.randn(2, 4, 20, generator=g)
    with torch.no_grad():
        out, probs = module(q, k, v)
        want_out, want_probs = _einsum_reference(module, q, k, v)
    assert out.shape == (2, 6, 5) and probs.shape == (2, 3, 6, 4)
    assert (module.to_q.bias is not None) == bias
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(probs, want_probs, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (dict(query=(2, 7, 511)), "query: expected shape (batch, length, 512), got (2, 7, 511)"),
        (dict(query=(7, 512)), "query: expected shape (batch, length, 512), got (7, 512)"),
        (dict(key=(2, 9, 256)), "key: expected shape (batch, length, 512), got (2, 9, 256)"),
        (dict(value=(2, 9, 64)), "value: expected shape (batch, length, 512), got (2, 9, 64)"),
        (dict(key=(3, 9, 512), value=(3, 9, 512)), "batch sizes disagree: query 2, key 3, value 3"),
        (dict(value=(2, 8, 512)), "key and value lengths disagree: key 9, value 8"),
        (dict(mask=(LK, LQ)), "got (9, 7)"),
        (dict(mask=(B, 8, LQ)), "got (2, 8, 7)"),
        (dict(mask=(B, 4, LQ, LK)), "got (2, 4, 7, 9)"),
        (dict(mask=(B, 1, 1, 1, LK)), "got (2, 1, 1, 1, 9)"),
        (dict(key_mask=(B, LQ)), "key_mask: expected (b, lk)=(2, 9), got (2, 7)"),
    ],
    ids=lambda v: "-".join(f"{k}{list(s)}" for k, s in v.items()) if isinstance(v, dict) else None,
)
def test_bad_shapes_name_the_tensor(seed000, shapes, message):
    _, ours = seed000
    tensors = dict(query=(B, LQ, 512), key=(B, LK, 512), value=(B, LK, 512)) | shapes
    kwargs = {name: torch.ones(shape) for name, shape in tensors.items()}
    with pytest.raises(ValueError) as exc:
        ours(**kwargs)
    assert message in str(exc.value)
    if "mask" in shapes:
        assert str(exc.value).startswith("mask: expected")


def test_dropout_only_in_training(seed000, qkv000):
    ref, ours = seed000
    assert ours.config.dropout == 0.1
    with torch.no_grad():
        eval_a, probs_a = ours(*qkv000)
        eval_b, _ = ours(*qkv000)
        torch.testing.assert_close(eval_a, eval_b, atol=0, rtol=0)
        try:
            ours.train()
            ref.train()
            torch.manual_seed(10)
            train_a, train_probs = ours(*qkv000)
            torch.manual_seed(11)
            train_b, _ = ours(*qkv000)
            torch.manual_seed(10)
            seed_train, _ = ref(*qkv000)
        finally:
            ours.eval()
            ref.eval()
    assert (train_a - eval_a).abs().max() > 1e-3, "dropout did nothing in training"
    assert (train_a - train_b).abs().max() > 1e-3, "dropout ignored the RNG"
    # Same RNG state, same dropout mask as seed 000, which also drops attention probs.
    torch.testing.assert_close(train_a, seed_train, **EXACT)
    # attn_probs are reported before dropout, as in seed 000.
    torch.testing.assert_close(train_probs, probs_a, **EXACT)


def test_config_defaults_resolve_to_query_dim():
    config = AttentionConfig(query_dim=48, num_heads=6)
    assert (config.d_model, config.kv_dim, config.out_dim, config.head_dim) == (48, 48, 48, 8)
    assert AttentionConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("kwargs", "numbers"),
    [
        (dict(query_dim=512, num_heads=7), ("512", "7")),
        (dict(query_dim=32, num_heads=4, d_model=30), ("30", "4")),
    ],
)
def test_config_refuses_d_model_not_divisible_by_heads(kwargs, numbers):
    with pytest.raises(ValueError) as exc:
        AttentionConfig(**kwargs)
    message = str(exc.value)
    assert f"d_model {numbers[0]} " in message and f"num_heads {numbers[1]}" in message


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(query_dim=0, num_heads=1), "query_dim must be an integer in 1..536870911, got 0"),
        (dict(query_dim=8, num_heads=2, kv_dim=-4), "kv_dim must be an integer in 1..536870911, got -4"),
        (dict(query_dim=8, num_heads=2, out_dim=2.5), "out_dim must be an integer in 1..536870911, got 2.5"),
        (dict(query_dim=8, num_heads=True), "num_heads must be an integer in 1..536870911, got True"),
        (dict(query_dim=2**29, num_heads=1), "query_dim must be an integer in 1..536870911, got 536870912"),
        (dict(query_dim=8, num_heads=2, dropout=1.0), "dropout must be in [0, 1), got 1.0"),
    ],
)
def test_config_refuses_bad_values(kwargs, fragment):
    with pytest.raises(ValueError) as exc:
        AttentionConfig(**kwargs)
    assert fragment in str(exc.value)
