"""The committed stubs match the protos, and the API package works without torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from hybridkv.api import client
from hybridkv.api import generation_pb2 as pb

REPO = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_regenerating_the_stubs_produces_no_diff():
    diff = _load_generator().check()
    assert not diff, "stubs are stale; run scripts/gen_protos.py:\n" + "".join(diff[:80])


def test_drift_check_notices_a_changed_stub(tmp_path, monkeypatch):
    generator = _load_generator()
    stale_dir = tmp_path / "protos"
    (stale_dir / "hybridkv" / "v1").mkdir(parents=True)
    for proto in generator.proto_files():
        (stale_dir / "hybridkv" / "v1" / proto.name).write_text(proto.read_text())
    for stub in generator.committed_stubs():
        (stale_dir / stub.name).write_text(stub.read_text().replace("GenerationService", "GenerationSvc"))
    monkeypatch.setattr(generator, "PROTOS_DIR", stale_dir)
    assert any(line.startswith("+") and "GenerationService" in line for line in generator.check())


def test_generated_stubs_import_under_hybridkv_api():
    assert pb.DESCRIPTOR.name == "hybridkv/v1/generation.proto"
    assert pb.DESCRIPTOR.package == "hybridkv.v1"
    assert set(pb.DESCRIPTOR.services_by_name["GenerationService"].methods_by_name) == {
        "Generate",
        "GetCapacity",
        "GetModelInfo",
    }


def test_client_imports_without_torch():
    # torch set to None in sys.modules makes any `import torch` fail, as in the operator image.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from hybridkv.api import client, cli\n"
        "from hybridkv.api.client import fetch_capacity, GenerationClient, AsyncGenerationClient\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_generate_request_carries_prompt_and_options():
    text_request = client.build_generate_request("hello", max_tokens=5, temperature=0.0, stop=["\n"], request_id="r1")
    assert text_request.WhichOneof("prompt") == "text"
    assert text_request.stopping.max_tokens == 5
    assert text_request.sampling.HasField("temperature") and text_request.sampling.temperature == 0.0
    assert not text_request.sampling.HasField("top_p")
    assert list(text_request.stopping.stop) == ["\n"]
    ids_request = client.build_generate_request([3, 1, 4], seed=7)
    assert ids_request.WhichOneof("prompt") == "token_ids"
    assert list(ids_request.token_ids.ids) == [3, 1, 4]
    assert ids_request.sampling.seed == 7
    assert not ids_request.stopping.HasField("max_tokens")


def test_capacity_dict_keeps_ints_and_marks_a_missing_prediction():
    report = pb.CapacityReport(block_size=16, token_blocks=2**40, state_slots=8, tensor_parallel_size=1)
    report.per_rank.add(block_size=16, token_blocks=2**40, state_slots=8)
    as_dict = client.capacity_to_dict(report)
    assert as_dict["token_blocks"] == 2**40 and isinstance(as_dict["token_blocks"], int)
    assert as_dict["predicted"] is None
    assert as_dict["per_rank"][0]["state_slots"] == 8
    assert as_dict["usage"] is None
