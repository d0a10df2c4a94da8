"""attnserve.runtime.AttentionPredictor: an exported version run in process as the server runs it.

Its answers equal the seeds' (tests.seed_reference, with the served demo weights) for both
presets, masked in every form the contract takes, in runs larger than max_batch_size and as a
table batch of mixed lengths with ids; bad input is a ValueError naming what was expected; and the
server's registry runs its batches through it. Real ONNX Runtime sessions, no server needed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from attnserve.server.config import ServerConfig
from attnserve.server.engine import choose_device
from attnserve.server.models import ModelRegistry
from attnserve.server.repository import read_model_spec

from attnserve import contract
from attnserve.runtime import AttentionPredictor
from tests.oip import eager
from tests.seed_reference import Seed000MultiHeadAttention, Seed002Multiheadattention

TOLERANCE = 1e-5
DIMS = {"self_attention": (512, 8), "cross_attention": (32, 2)}  # width, heads


@pytest.fixture(scope="module")
def seeds(eager_modules):
    """The seeds' own classes with the served weights: seed 000 (Wq..Wo) for self_attention,
    seed 002 (to_q..to_out, no mask) for cross_attention."""
    ours = eager_modules["self_attention"].state_dict()
    names = {"to_q": "Wq", "to_k": "Wk", "to_v": "Wv", "to_out": "Wo"}
    seed000 = Seed000MultiHeadAttention(d_model=512, n_heads=8, dropout=0.1)
    seed000.load_state_dict({f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in ours.items()})
    seed002 = Seed002Multiheadattention(input_dim=32, heads=2, d_model=32)
    seed002.load_state_dict(eager_modules["cross_attention"].state_dict())
    return {"self_attention": seed000.eval(), "cross_attention": seed002.eval()}


def seed_answer(name: str, seeds, eager_modules, x: dict) -> dict:
    """The seed's answer. Seed 000 broadcasts a 3-D mask as (1, b, lq, lk): it is handed the
    contract's (b, lq, lk) as (b, 1, lq, lk). Seed 002 takes no mask and returns no probabilities:
    masked cross_attention is checked against the module the export traced (test_checkpoint
    proves it equals seed 002)."""
    mask = x.get("mask")
    if name == "cross_attention":
        if mask is None:
            with torch.no_grad():
                out = seeds[name](*(torch.from_numpy(x[n]) for n in ("query", "key", "value")))
            return {"output": out.numpy()}
        return eager(eager_modules[name], x["query"], x["key"], x["value"], mask)
    if mask is not None and mask.ndim == 3:
        mask = mask[:, None]
    return eager(seeds[name], x["query"], x["key"], x["value"], mask)


def items(name: str, rng: np.random.Generator, n: int, lq: int, lk: int, form: str | None) -> dict:
    width, h = DIMS[name]
    x = {k: rng.standard_normal((n, length, width), dtype=np.float32)
         for k, length in (("query", lq), ("key", lk), ("value", lk))}
    if form is not None:
        shape = {"q_k": (lq, lk), "b_q_k": (n, lq, lk), "b_1_q_k": (n, 1, lq, lk), "b_h_q_k": (n, h, lq, lk)}[form]
        mask = rng.random(shape) > 0.33
        mask[..., 0] = True
        mask[(0,) * (len(shape) - 2) + (0,)] = False  # one fully masked row: the seeds' uniform distribution
        x["mask"] = mask
    return x


def assert_close(got: dict, want: dict) -> None:
    for name in want:
        assert got[name].shape == want[name].shape, name
        err = float(np.max(np.abs(got[name] - want[name])))
        assert err <= TOLERANCE, f"{name}: max abs error {err}"


@pytest.fixture(scope="module")
def predictors(model_repository):
    return {name: AttentionPredictor(model_repository / name, max_batch_size=4) for name in DIMS}


@pytest.mark.parametrize("name", sorted(DIMS))
@pytest.mark.parametrize("form", [None, "q_k", "b_q_k", "b_1_q_k", "b_h_q_k"])
def test_predict_equals_the_seed(predictors, seeds, eager_modules, name, form):
    """10 items in runs of at most 4 rows (max_batch_size), each mask form, with and without attn_probs."""
    predictor = predictors[name]
    x = items(name, np.random.default_rng(31), 10, 7, 9, form)
    want = seed_answer(name, seeds, eager_modules, x)
    for want_probs in (False, True):
        output, attn_probs = predictor.predict(x["query"], x["key"], x["value"], x.get("mask"), want_probs)
        got = {"output": output}
        if want_probs:
            got["attn_probs"] = attn_probs
        else:
            assert attn_probs is None
        assert_close(got, {k: v for k, v in want.items() if k in got})


@pytest.mark.parametrize("name", sorted(DIMS))
def test_long_unmasked_runs_take_the_fused_graph_and_equal_the_seed(predictors, seeds, eager_modules, name):
    """Past the export's crossover the server runs the fused graph; so does the predictor."""
    predictor = predictors[name]
    length = max(predictor.engine.graphs.crossover.values(), default=64)
    x = items(name, np.random.default_rng(32), 2, length, length, None)
    before = predictor.engine.runs[contract.FUSED]
    output, _ = predictor.predict(x["query"], x["key"], x["value"])
    assert predictor.engine.runs[contract.FUSED] == before + 1
    assert_close({"output": output}, {"output": seed_answer(name, seeds, eager_modules, x)["output"]})


def test_a_table_batch_of_mixed_lengths_keeps_ids_and_order(model_repository, seeds, eager_modules):
    """Ray Data's numpy batch: object columns whose items differ in length, masks and ids."""
    predictor = AttentionPredictor(model_repository / "self_attention", outputs=("output", "attn_probs"))
    rng = np.random.default_rng(33)
    shapes = [(5, 6), (3, 4), (5, 6), (2, 9)]
    xs = [items("self_attention", rng, 1, lq, lk, "b_q_k") for lq, lk in shapes]
    column = lambda name: np.array([x[name][0] for x in xs] + [None], dtype=object)[:-1]  # noqa: E731
    batch = {name: column(name) for name in ("query", "key", "value", "mask")}
    batch["id"] = np.array([40, 41, 42, 43])
    got = predictor(batch)
    assert list(got) == ["id", "output", "attn_probs"] and got["id"].tolist() == [40, 41, 42, 43]
    for i, x in enumerate(xs):
        want = seed_answer("self_attention", seeds, eager_modules, x)
        assert_close({"output": got["output"][i][None], "attn_probs": got["attn_probs"][i][None]}, want)


def test_a_table_batch_of_one_shape_is_stacked(predictors, seeds, eager_modules):
    x = items("cross_attention", np.random.default_rng(34), 6, 4, 5, None)
    got = predictors["cross_attention"]({"query": x["query"], "key": x["key"], "value": x["value"]})
    assert list(got) == ["output"] and got["output"].shape == (6, 4, 32)
    assert_close(got, {"output": seed_answer("cross_attention", seeds, eager_modules, x)["output"]})


@pytest.mark.parametrize("case, message", [
    ({"query": np.zeros((2, 3, 31), np.float32)}, "query: expected (items, q_len, 32), got (2, 3, 31)"),
    ({"key": np.zeros((2, 4, 32), np.float32)}, "key and value: expected (2, k_len, 32) each"),
    ({"mask": np.ones((2, 3), bool)}, "mask: expected one of the shapes"),
    ({"mask": np.full((2, 3, 5), 2)}, "mask: expected bool or 0/1 integers"),
])
def test_bad_input_is_a_value_error_naming_what_was_expected(predictors, case, message):
    x = {"query": np.zeros((2, 3, 32), np.float32), "key": np.zeros((2, 5, 32), np.float32),
         "value": np.zeros((2, 5, 32), np.float32), "mask": None, **case}
    with pytest.raises(ValueError) as exc:
        predictors["cross_attention"].predict(x["query"], x["key"], x["value"], x["mask"])
    assert message in str(exc.value)


def test_a_batch_without_query_names_the_columns(predictors):
    with pytest.raises(ValueError) as exc:
        predictors["cross_attention"]({"key": np.zeros((1, 2, 32), np.float32)})
    assert "no 'query' column" in str(exc.value)


def test_the_servers_registry_runs_its_batches_through_the_predictor(model_repository):
    """The server and the batch adapters share one loader and run: the registry's run is the
    predictor's (a second copy of the loading code would drift from it)."""
    registry = ModelRegistry(ServerConfig(model_repository=str(model_repository)), choose_device("cpu"))
    opened = registry._open(read_model_spec(model_repository / "cross_attention"))
    assert isinstance(opened.run.__self__, AttentionPredictor)
    assert opened.graphs is opened.run.__self__.engine.graphs
    # On the CPU its runs write outputs into shared memory themselves (server.tensors.compute_batch).
    assert opened.writes_into is opened.run.__self__.engine.writes_into is True
