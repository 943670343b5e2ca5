"""A tiny checkpoint and the engine and server settings the serving tests share.

Test modules import what they use (`from serving_fixtures import serving_checkpoint, engine_config, server_config`);
pytest then treats the imported fixture as the module's own, so each module builds its own checkpoint once.
"""

from __future__ import annotations

import pytest

MAX_NUM_SEQS = 4
MAX_QUEUE = 28  # state slots + queue = 32 requests in flight
MAX_MODEL_LEN = 256
KV_CACHE_MEMORY_BYTES = 8 * 1024**2


def engine_config(model_dir, **overrides):
    from hybridkv.sidecar.core.config import EngineConfig

    settings = dict(model=str(model_dir), max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                    max_num_batched_tokens=512, kv_cache_memory_bytes=KV_CACHE_MEMORY_BYTES, device="cpu")
    settings.update(overrides)
    return EngineConfig(**settings)


def server_config(**overrides):
    from hybridkv.sidecar.serving.server import ServerConfig

    settings = dict(host="127.0.0.1", port=0, metrics_port=0, max_queue=MAX_QUEUE, grace_period_s=5.0)
    settings.update(overrides)
    return ServerConfig(**settings)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    return make_model(tmp_path_factory.mktemp("tiny-qwen3.5"), catalog_geometry("qwen3.5-4b"), seed=7, tiny=True)
