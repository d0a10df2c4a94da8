"""Writes the native fuzzer's model table and seed corpus (`make fuzz-native`).

    python native/fuzz/seeds.py BUILD_DIR    # BUILD_DIR/plane_models.txt, BUILD_DIR/seeds/*

plane_models.txt holds the contract's names and datatypes (attnserve.contract, as server.native
hands them to the plane) and one line per preset: its dims (tests/test_fuzz.py's DIMS) with the
serving defaults and the server's default limits, as server.native.NativePlane passes them. The
seeds are the cases of tests/test_fuzz.py (requests drawn from its hypothesis strategy, derandomized),
tests/test_native_plane.py's bad requests, valid requests of each mask form and a few byte strings
that are no message at all.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from attnserve.server.config import ServerConfig  # noqa: E402
from attnserve.server.native import CONTRACT_NAMES  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from attnserve import contract  # noqa: E402
from tests import test_fuzz  # noqa: E402
from tests.oip import infer_request  # noqa: E402
from tests.test_mask_shapes import inputs  # noqa: E402

DRAWN = 400  # requests drawn from test_fuzz's strategy
MAX_SEED_BYTES = 64 << 10  # make fuzz-native's -max_len: a longer seed would only be cut
GARBAGE = [b"", b"\xff\xff\xff\xff\x0f garbage", b"\x0a\xff\xff\xff\xff\x0f", b"\x12\x05model", b"\x00" * 16]


def model_table() -> str:
    names = [CONTRACT_NAMES[k] for k in ("query", "key", "value", "mask", "output", "attn_probs", "fp32", "bool")]
    serving, cfg = contract.ServingDefaults(), ServerConfig()
    lines = [" ".join(names)]
    for name, (q_dim, kv_dim, out_dim, heads) in sorted(test_fuzz.DIMS.items()):
        lines.append(" ".join(str(v) for v in (
            name, 1, q_dim, kv_dim, out_dim, heads, cfg.max_batch_size or serving.max_batch_size, serving.max_q_len,
            serving.max_kv_len, cfg.max_attention_bytes, cfg.max_queue_size, cfg.max_padding_ratio)))
    return "\n".join(lines) + "\n"


def seeds() -> list[bytes]:
    out: list[bytes] = list(GARBAGE)

    @settings(max_examples=DRAWN, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(request=test_fuzz.malformed_requests())
    def draw(request):
        out.append(request.SerializeToString())

    draw()
    from tests.test_native_plane import BAD  # its bad requests (imports the extension's wrapper only)

    out += [r.SerializeToString() for r in BAD.values()]
    rng = np.random.default_rng(0)
    for model in sorted(test_fuzz.DIMS):
        for form in (None, "q_k", "b_q_k", "b_1_q_k", "b_h_q_k"):
            x = inputs(model, rng, 2, 3, 4, form)
            if x["mask"] is not None and x["mask"].ndim == 4:  # heads alike: what the plane serves
                x["mask"] = np.ascontiguousarray(np.repeat(x["mask"][:, :1], x["mask"].shape[1], axis=1))
            for raw in (True, False):
                out.append(infer_request(model, raw=raw, **x).SerializeToString())
    return out


def main(build: Path) -> None:
    build.mkdir(parents=True, exist_ok=True)
    (build / "plane_models.txt").write_text(model_table())
    corpus = build / "seeds"
    corpus.mkdir(exist_ok=True)
    written = 0
    for data in seeds():
        if len(data) > MAX_SEED_BYTES:
            continue
        path = corpus / hashlib.sha1(data).hexdigest()
        if not path.exists():
            path.write_bytes(data)
            written += 1
    print(f"fuzz seeds: {written} new in {corpus}, model table in {build / 'plane_models.txt'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
