"""The gRPC sidecar against the real tiny CPU engine, on loopback: streaming, admission, cancellation, health, metrics.

One server (with its engine) is shared by the module; the drain and auth tests use servers of their own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

pytest.importorskip("torch")

from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hybridkv.api import generation_pb2 as pb  # noqa: E402
from hybridkv.net import free_loopback_port  # noqa: E402
from serving_fixtures import (  # noqa: E402,F401 (model_dir is a fixture)
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MAX_QUEUE,
    engine_config,
    model_dir,
    server_config,
)
from hybridkv.api.client import (  # noqa: E402
    LIVENESS_SERVICE,
    READINESS_SERVICE,
    RETRY_AFTER_METADATA_KEY,
    AsyncGenerationClient,
    GenerationClient,
)

PROMPTS = (
    "The token pool is split into blocks",
    "A hybrid language model mixes",
    "Requests arrive, wait for a free slot",
    "Numbers: 0 1 2 3",
)
POLL_LIMIT_S = 30.0








@pytest.fixture(scope="module")
def reference_engine(model_dir):
    """An engine outside any server, for offline reference outputs (and for the drain test's own server)."""
    from hybridkv.sidecar.core.engine import Engine

    return Engine(engine_config(model_dir))


@pytest.fixture(scope="module")
def sidecar(model_dir):
    from hybridkv.sidecar.serving.server import BackgroundServer

    background = BackgroundServer(engine_config(model_dir), server_config(metrics_port=0)).start().load()
    yield background
    background.close()


@pytest.fixture(scope="module")
def metrics_sidecar(model_dir):
    """The module's server has no metrics port; this one serves /metrics on a free port."""
    from hybridkv.sidecar.serving.server import BackgroundServer

    background = BackgroundServer(engine_config(model_dir), server_config(metrics_port=free_loopback_port())).start().load()
    yield background
    background.close()


@pytest.fixture
def client(sidecar):
    with GenerationClient(sidecar.target) as generation_client:
        yield generation_client


def _collect(responses) -> tuple[list[int], str, pb.GenerateResponse]:
    token_ids, text, last = [], [], None
    for response in responses:
        token_ids.extend(response.token_ids)
        text.append(response.text)
        last = response
    return token_ids, "".join(text), last


def _wait_for_usage(client: GenerationClient, predicate) -> dict:
    """Polls GetCapacity until `predicate(usage)` holds; fails with the last usage after POLL_LIMIT_S."""
    deadline_s = time.monotonic() + POLL_LIMIT_S
    while True:
        usage = client.get_capacity()["usage"]
        if predicate(usage):
            return usage
        assert time.monotonic() < deadline_s, f"usage never reached the expected state: {usage}"
        time.sleep(0.02)


def _idle(usage: dict) -> bool:
    return usage == {"used_token_blocks": 0, "used_state_slots": 0, "running": 0, "waiting": 0,
                     "cached_token_blocks": 0, "used_checkpoint_slots": 0}


def test_stream_round_trip_matches_the_engine_offline(client, reference_engine):
    from hybridkv.sidecar.core.sampling import SamplingParams

    prompt = PROMPTS[0]
    token_ids, text, last = _collect(client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True))
    [offline] = reference_engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert token_ids == offline.token_ids
    assert text == offline.text
    assert last.finished and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == len(reference_engine.tokenizer.encode(prompt))
    assert last.usage.completion_tokens == 12


def test_the_last_response_says_where_the_requests_time_went_on_the_server(client):
    """Only the last response has `times`; the server's time to first token holds the engine's queue and prefill,
    and the client's own holds the server's (the same machine: durations, not clock readings, are compared)."""
    started = time.perf_counter()
    responses = []
    for response in client.generate(PROMPTS[0], max_tokens=6, temperature=0.0, ignore_eos=True):
        responses.append((time.perf_counter() - started, response))
    client_ttft_s, last = responses[0][0], responses[-1][1]
    assert [response.HasField("times") for _, response in responses] == [False] * (len(responses) - 1) + [True]
    times = last.times
    assert min(times.queue_s, times.prefill_s, times.decode_s) >= 0 and times.prefill_s > 0
    assert times.queue_s + times.prefill_s <= times.time_to_first_token_s <= client_ttft_s


def test_token_id_prompt_and_request_id_are_echoed(client, reference_engine):
    prompt_ids = reference_engine.tokenizer.encode(PROMPTS[1])
    responses = list(client.generate(prompt_ids, max_tokens=3, temperature=0.0, ignore_eos=True, request_id="mine-1"))
    assert {response.request_id for response in responses} == {"mine-1"}
    assert responses[-1].usage.prompt_tokens == len(prompt_ids)


def test_thirty_two_concurrent_streams_all_complete_with_correct_usage(sidecar, reference_engine):
    max_tokens = 6

    async def run_all():
        async with AsyncGenerationClient(sidecar.target) as client:
            async def one(index: int):
                prompt = PROMPTS[index % len(PROMPTS)]
                token_ids, last = [], None
                async for response in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                    token_ids.extend(response.token_ids)
                    last = response
                return prompt, token_ids, last

            return await asyncio.gather(*(one(index) for index in range(32)))

    results = asyncio.run(run_all())
    assert len(results) == 32
    by_prompt: dict[str, set[tuple[int, ...]]] = {}
    for prompt, token_ids, last in results:
        assert last.finished and last.finish_reason == pb.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == max_tokens == len(token_ids)
        assert last.usage.prompt_tokens == len(reference_engine.tokenizer.encode(prompt))
        by_prompt.setdefault(prompt, set()).add(tuple(token_ids))
    # Greedy decoding: every stream of one prompt got the same tokens, however the batches were formed.
    assert all(len(outputs) == 1 for outputs in by_prompt.values()), by_prompt
    with GenerationClient(sidecar.target) as client:
        assert _idle(_wait_for_usage(client, _idle))


def test_cancelling_mid_stream_frees_the_slot_and_blocks(client):
    stream = client.generate(PROMPTS[2] * 2, max_tokens=200, temperature=0.0, ignore_eos=True)
    first = next(stream)
    assert first.request_id
    busy = client.get_capacity()["usage"]
    assert busy["used_state_slots"] == 1 and busy["used_token_blocks"] >= 1
    stream.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        list(stream)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert _idle(_wait_for_usage(client, _idle))


def test_deadline_exceeded_aborts_the_request(client):
    with pytest.raises(grpc.RpcError) as caught:
        _collect(client.generate(PROMPTS[3], max_tokens=240, temperature=0.0, ignore_eos=True, timeout_s=0.3))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _idle(_wait_for_usage(client, _idle))


def test_full_queue_answers_resource_exhausted_with_a_retry_hint(sidecar, client):
    limit = MAX_NUM_SEQS + MAX_QUEUE
    streams = [
        client.generate(PROMPTS[index % len(PROMPTS)], max_tokens=200, temperature=0.0, ignore_eos=True)
        for index in range(limit)
    ]
    try:
        _wait_for_usage(client, lambda usage: usage["running"] + usage["waiting"] == limit)
        with pytest.raises(grpc.RpcError) as caught:
            _collect(client.generate(PROMPTS[0], max_tokens=2))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue full" in caught.value.details()
        hint = dict(caught.value.trailing_metadata())[RETRY_AFTER_METADATA_KEY]
        assert int(hint) > 0
    finally:
        for stream in streams:
            stream.cancel()
    assert _idle(_wait_for_usage(client, _idle))
    # Once the queue has room again, requests are admitted.
    assert _collect(client.generate(PROMPTS[0], max_tokens=2, ignore_eos=True))[2].finished


BAD_REQUESTS = {
    "empty text": (pb.GenerateRequest(text=""), "prompt is empty"),
    "no prompt": (pb.GenerateRequest(), "prompt is empty"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt is empty"),
    "over-long prompt": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * (MAX_MODEL_LEN + 1))), "exceeds max_model_len"),
    "max tokens past the model length": (
        pb.GenerateRequest(text="hello", stopping=pb.StoppingCriteria(max_tokens=MAX_MODEL_LEN)),
        "exceeds max_model_len"),
    "zero max tokens": (pb.GenerateRequest(text="hello", stopping=pb.StoppingCriteria(max_tokens=0)), "max_tokens"),
    "negative temperature": (
        pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(temperature=-0.5)), "temperature"),
    "top_p above one": (pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(top_p=1.5)), "top_p"),
    "negative top_k": (pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(top_k=-1)), "top_k"),
    "token id outside the vocabulary": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])), "vocabulary"),
    "unprintable request id": (pb.GenerateRequest(request_id="a\nb", text="hello"), "request_id"),
    "presence penalty out of range": (
        pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(presence_penalty=3.0)), "presence_penalty"),
    "too many logprobs": (pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(logprobs=50)), "logprobs"),
    "min_p above one": (pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(min_p=1.5)), "min_p"),
    "min tokens above max tokens": (
        pb.GenerateRequest(text="hello", stopping=pb.StoppingCriteria(max_tokens=4, min_tokens=5)), "min_tokens"),
    "logit bias outside the vocabulary": (
        pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(logit_bias={10**6: 1.0})), "logit_bias token id"),
    "logit bias past 100": (
        pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(logit_bias={3: 150.0})), "logit_bias of token 3"),
}


def test_each_bad_request_is_invalid_argument_and_leaves_other_streams_alone(sidecar, client, reference_engine):
    from hybridkv.api.generation_pb2_grpc import GenerationServiceStub

    from hybridkv.sidecar.core.sampling import SamplingParams

    [expected] = reference_engine.generate([PROMPTS[1]], SamplingParams(max_tokens=20, temperature=0.0,
                                                                          ignore_eos=True))
    stub = GenerationServiceStub(grpc.insecure_channel(sidecar.target))
    good = client.generate(PROMPTS[1], max_tokens=20, temperature=0.0, ignore_eos=True)
    first = next(good)
    reasons = {}
    for name, (request, reason) in BAD_REQUESTS.items():
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        reasons[name] = caught.value.details()
        assert reason in caught.value.details(), (name, caught.value.details())
    token_ids, _, last = _collect(good)
    assert list(first.token_ids) + token_ids == expected.token_ids
    assert last.finish_reason == pb.FINISH_REASON_LENGTH


def test_capacity_and_model_info_report_the_engine(client, reference_engine):
    capacity = client.get_capacity()
    expected = reference_engine.capacity().to_dict()
    assert {key: value for key, value in capacity.items() if key != "usage"} == {
        key: value for key, value in expected.items() if key != "usage"}
    assert capacity["state_slots"] == MAX_NUM_SEQS
    assert capacity["token_capacity"] == capacity["token_blocks"] * capacity["block_size"]
    info = client.get_model_info()
    assert info["max_model_len"] == MAX_MODEL_LEN
    assert info["vocab_size"] == reference_engine.geometry.vocab_size
    assert info["eos_token_ids"] == list(reference_engine.tokenizer.eos_token_ids)
    assert info["server_version"]


def test_reflection_lists_the_services(sidecar):
    channel = grpc.insecure_channel(sidecar.target)
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [reply] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {service.name for service in reply.list_services_response.service}
    assert {"hybridkv.v1.GenerationService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    [reply] = list(stub.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="hybridkv.v1.GenerationService")])))
    assert reply.file_descriptor_response.file_descriptor_proto


def _scrape(port: int) -> dict[str, dict]:
    """Samples of a /metrics scrape parsed by prometheus_client: {metric family: {sample name + labels: value}}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value for sample in family.samples}
    return families


def test_metrics_scrape_parses_and_moves_under_load(metrics_sidecar, model_dir):
    port = metrics_sidecar.server.metrics_port
    # vLLM's series carry the served model's name, which the Gateway API Inference Extension selects on.
    model = (("model_name", os.path.basename(str(model_dir))),)
    before = _scrape(port)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "hybridkv:token_pool_usage_perc", "hybridkv:state_pool_usage_perc", "hybridkv:token_blocks_total",
                 "hybridkv:state_slots_total", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "hybridkv:cache_config_info"):
        assert name in before, name
    assert before["hybridkv:state_slots_total"][("hybridkv:state_slots_total", ())] == MAX_NUM_SEQS
    [(info_key, _)] = before["hybridkv:cache_config_info"].items()
    assert dict(info_key[1])["model_name"]
    with GenerationClient(metrics_sidecar.target) as client:
        stream = client.generate(PROMPTS[0], max_tokens=200, temperature=0.0, ignore_eos=True)
        next(stream)
        deadline_s = time.monotonic() + POLL_LIMIT_S
        while _scrape(port)["vllm:num_requests_running"][("vllm:num_requests_running", model)] != 1:
            assert time.monotonic() < deadline_s, "running gauge never showed the request"
            time.sleep(0.02)
        busy = _scrape(port)
        assert busy["hybridkv:state_pool_usage_perc"][("hybridkv:state_pool_usage_perc", ())] == 1 / MAX_NUM_SEQS
        stream.cancel()
        _collect(client.generate(PROMPTS[1], max_tokens=5, temperature=0.0, ignore_eos=True))
        _wait_for_usage(client, _idle)
    after = _scrape(port)

    def value(families, family, sample, labels=()):
        return families[family].get((sample, labels), 0.0)

    assert value(after, "vllm:generation_tokens", "vllm:generation_tokens_total", model) >= value(
        before, "vllm:generation_tokens", "vllm:generation_tokens_total", model) + 6
    assert value(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model) > value(
        before, "vllm:prompt_tokens", "vllm:prompt_tokens_total", model)
    ttft = ("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count")
    assert value(after, *ttft) == value(before, *ttft) + 2
    itl = ("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    assert value(after, *itl) >= value(before, *itl) + 4
    success = ("vllm:request_success", "vllm:request_success_total")
    assert value(after, *success, (("finished_reason", "length"),)) == value(
        before, *success, (("finished_reason", "length"),)) + 1
    assert value(after, *success, (("finished_reason", "abort"),)) == value(
        before, *success, (("finished_reason", "abort"),)) + 1
    assert ("vllm:num_requests_running", model) in after["vllm:num_requests_running"]
    assert value(after, "vllm:num_requests_running", "vllm:num_requests_running", model) == 0
    # The request latency histograms count the request that finished (the cancelled one had no final output), and
    # the engine's queue and inference time nest inside the server's end-to-end time.
    phases = ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
              "request_inference_time")
    grew = {}
    for phase in phases:
        family = f"vllm:{phase}_seconds"
        assert value(after, family, f"{family}_count") == value(before, family, f"{family}_count") + 1, phase
        grew[phase] = value(after, family, f"{family}_sum") - value(before, family, f"{family}_sum")
    assert grew["request_prefill_time"] > 0 and grew["request_decode_time"] > 0
    assert grew["request_inference_time"] == pytest.approx(grew["request_prefill_time"] + grew["request_decode_time"])
    assert grew["e2e_request_latency"] >= grew["request_queue_time"] + grew["request_inference_time"]


def test_health_turns_ready_after_capacity_and_not_serving_on_drain(model_dir):
    from hybridkv.sidecar.serving.server import BackgroundServer

    background = BackgroundServer(engine_config(model_dir), server_config(grace_period_s=0.5)).start()
    try:
        with GenerationClient(background.target) as client:
            assert client.check_health(LIVENESS_SERVICE) == "SERVING"
            assert client.check_health(READINESS_SERVICE) == "NOT_SERVING"
            assert client.check_health("") == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as caught:
                client.get_capacity()
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            background.load()
            assert client.check_health(READINESS_SERVICE) == "SERVING"
            assert client.check_health("") == "SERVING"
            assert client.get_capacity()["state_slots"] == MAX_NUM_SEQS
            long_stream = client.generate(PROMPTS[0], max_tokens=240, temperature=0.0, ignore_eos=True)
            next(long_stream)
            # A stopped engine cannot finish the stream within the grace period, however fast the machine.
            os.kill(background.server.engine.pid, signal.SIGSTOP)
            drain = ThreadPoolExecutor(max_workers=1).submit(background.drain)
            deadline_s = time.monotonic() + POLL_LIMIT_S
            while client.check_health(READINESS_SERVICE) != "NOT_SERVING":
                assert time.monotonic() < deadline_s
                time.sleep(0.01)
            assert client.check_health(LIVENESS_SERVICE) == "SERVING"
            with pytest.raises(grpc.RpcError) as caught:
                _collect(client.generate(PROMPTS[1], max_tokens=2))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in caught.value.details()
            # The in-flight stream outlives the 0.5 s grace period and ends with an abort, not an error.
            _, _, last = _collect(long_stream)
            assert last.finished and last.finish_reason == pb.FINISH_REASON_ABORT
            assert last.usage.completion_tokens >= 1  # what it streamed before the abort still counts
            os.kill(background.server.engine.pid, signal.SIGCONT)
            drain.result(timeout=POLL_LIMIT_S)
    finally:
        background.close()
    # The engine process's last report, sent once the drain's aborts had freed every slot and block.
    final = background.server.stats_snapshot
    assert (final.running, final.waiting, final.used_state_slots, final.used_token_blocks) == (0, 0, 0, 0)
    assert background.server.engine.exitcode == 0


def test_a_killed_engine_process_fails_its_streams_and_turns_not_serving(model_dir):
    from hybridkv.sidecar.serving.server import BackgroundServer

    background = BackgroundServer(engine_config(model_dir), server_config()).start().load()
    try:
        with GenerationClient(background.target) as client:
            stream = client.generate(PROMPTS[0], max_tokens=240, temperature=0.0, ignore_eos=True)
            next(stream)
            os.kill(background.server.engine.pid, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as caught:
                _collect(stream)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "SIGKILL" in caught.value.details()
            deadline_s = time.monotonic() + POLL_LIMIT_S
            while client.check_health(LIVENESS_SERVICE) == "SERVING":
                assert time.monotonic() < deadline_s, "liveness never turned NOT_SERVING"
                time.sleep(0.02)
            assert client.check_health(READINESS_SERVICE) == "NOT_SERVING"
            for call in (lambda: _collect(client.generate(PROMPTS[1], max_tokens=2)), client.get_capacity):
                with pytest.raises(grpc.RpcError) as caught:
                    call()
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "engine process" in caught.value.details()
    finally:
        background.close()


def test_bearer_token_rejects_missing_and_wrong_tokens_but_not_health(model_dir):
    from hybridkv.sidecar.serving.server import BackgroundServer

    background = BackgroundServer(engine_config(model_dir), server_config(auth_token="s3cret-token")).start()
    try:
        for token in (None, "wrong-token"):
            with GenerationClient(background.target, token=token) as client:
                with pytest.raises(grpc.RpcError) as caught:
                    client.get_capacity()
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as caught:
                    _collect(client.generate("hello", max_tokens=2))
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert client.check_health(LIVENESS_SERVICE) == "SERVING"
        with GenerationClient(background.target, token="s3cret-token") as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.get_capacity()
            # Past the token check: the model is not loaded on this server.
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        background.close()


def test_generate_command_streams_the_text_to_the_terminal(sidecar, reference_engine, capsys):
    from hybridkv.cli import main
    from hybridkv.sidecar.core.sampling import SamplingParams

    [offline] = reference_engine.generate([PROMPTS[2]], SamplingParams(max_tokens=10, temperature=0.0,
                                                                         ignore_eos=True))
    rc = main(["generate", "--target", sidecar.target, "--max-tokens", "10", "--ignore-eos", "--usage", PROMPTS[2]])
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.out == offline.text + "\n"
    assert "[length]" in captured.err and "completion_tokens=10" in captured.err


def self_signed_localhost_certificate() -> tuple[bytes, bytes]:
    """A one-day EC certificate for localhost and 127.0.0.1, and its key, both PEM."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return certificate.public_bytes(serialization.Encoding.PEM), key_pem


def test_tls_serves_generation_encrypted_and_health_in_plaintext_on_its_own_port(model_dir):
    from hybridkv.sidecar.serving.server import BackgroundServer

    cert_pem, key_pem = self_signed_localhost_certificate()
    config = server_config(tls_cert_pem=cert_pem, tls_key_pem=key_pem, health_port=0)
    background = BackgroundServer(engine_config(model_dir), config).start()
    try:
        port, health_port = background.server.port, background.server.health_port
        assert health_port != port
        with GenerationClient(f"localhost:{port}", tls_ca=cert_pem) as client:
            with pytest.raises(grpc.RpcError) as caught:
                client.get_capacity()
            # The TLS handshake succeeded: the answer is the server's own (model not loaded here).
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in caught.value.details()
        with GenerationClient(f"127.0.0.1:{port}") as plaintext:
            with pytest.raises(grpc.RpcError) as caught:
                plaintext.get_capacity(timeout_s=2.0)
            assert caught.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        with GenerationClient(f"127.0.0.1:{health_port}") as probe:
            assert probe.check_health(LIVENESS_SERVICE) == "SERVING"
            assert probe.check_health(READINESS_SERVICE) == "NOT_SERVING"
            with pytest.raises(grpc.RpcError) as caught:
                probe.get_capacity()
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        background.close()


def test_with_tls_the_http_api_answers_over_https_only(model_dir, tmp_path):
    """The same certificate serves the OpenAI-compatible API: the openai client reaches it over HTTPS trusting that
    certificate, and a plaintext request gets no HTTP answer."""
    import http.client
    import ssl

    import openai

    from hybridkv.sidecar.serving.server import BackgroundServer

    cert_pem, key_pem = self_signed_localhost_certificate()
    (tmp_path / "ca.pem").write_bytes(cert_pem)
    config = server_config(tls_cert_pem=cert_pem, tls_key_pem=key_pem, health_port=0, http_port=free_loopback_port())
    background = BackgroundServer(engine_config(model_dir), config).start()
    try:
        port = background.server.http_port
        with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))) as https:
            client = openai.OpenAI(base_url=f"https://localhost:{port}/v1", api_key="none", http_client=https,
                                   max_retries=0)
            # The handshake succeeded: the answer is the server's own (the model is not loaded in this test).
            with pytest.raises(openai.APIStatusError) as caught:
                client.completions.create(model=model_dir.name, prompt="hello", max_tokens=2)
            assert caught.value.status_code == 503
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2.0)
    finally:
        background.close()


def test_a_stream_that_falls_behind_catches_up_in_fewer_messages(sidecar, client, reference_engine):
    from hybridkv.sidecar.core.sampling import SamplingParams

    [expected] = reference_engine.generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0.0,
                                                                          ignore_eos=True))
    stream = client.generate(PROMPTS[0], max_tokens=40, temperature=0.0, ignore_eos=True)
    responses = [next(stream)]
    # Stall the server's event loop while the engine process keeps stepping: the tokens pile up for this stream.
    sidecar.loop.call_soon_threadsafe(time.sleep, 1.0)
    responses += list(stream)
    token_ids = [token_id for response in responses for token_id in response.token_ids]
    assert token_ids == expected.token_ids
    assert "".join(response.text for response in responses) == expected.text
    assert len(responses) < 40
    assert responses[-1].usage.completion_tokens == 40
