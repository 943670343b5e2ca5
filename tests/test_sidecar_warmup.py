"""No compiles after ready: the warm-up plan covers every kernel configuration a served step can have, compiles are
counted through Triton's hook and exported, and start-up reports where its time went."""

from __future__ import annotations

import logging
import random
import time
from types import SimpleNamespace

import pytest
import torch
from engine_fixtures import make_engine, tiny_checkpoint  # noqa: F401 - pytest fixture

from hybridkv.sidecar.core.sampling import SamplingParams
from hybridkv.sidecar.execution.warmup import (JitCompileCounter, KernelShapes, step_keys, warmup_batch,
                                               warmup_plan)

# One H200 rank of the Qwen3.5-4B geometry in bf16 (132 SMs, Hopper's opt-in shared memory).
H200_4B = KernelShapes(num_kv_heads=4, attention_group=4, head_dim=256, kv_element_bytes=2, block_size=16,
                       num_v_heads=32, head_k_dim=128, head_v_dim=128, state_element_bytes=2, num_experts=0,
                       experts_per_token=0, multiprocessors=132, shared_memory_bytes=232_448)
H200_MOE_TP2 = KernelShapes(num_kv_heads=1, attention_group=8, head_dim=256, kv_element_bytes=2, block_size=16,
                            num_v_heads=16, head_k_dim=128, head_v_dim=128, state_element_bytes=2, num_experts=256,
                            experts_per_token=8, multiprocessors=132, shared_memory_bytes=232_448)
LIMITS = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "max_model_len": 8192}


def served_step(rng: random.Random, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                graphs: bool):
    """A step the scheduler can form: decodes at any contexts, then prefill chunks of any lengths."""
    while True:
        decodes = rng.randint(0, max_num_seqs)
        prefills = rng.randint(0 if decodes and not graphs else 1, max(1, min(max_num_seqs - decodes, 64)))
        if decodes + prefills == 0 or decodes + prefills > max_num_seqs:
            continue
        chunks = [rng.choice([2, 3, 5, 17, 64, 300, 2048, 8000]) for _ in range(prefills)]
        tokens = decodes + sum(chunks)
        if tokens > max_num_batched_tokens:
            continue
        decode_contexts = [rng.randint(1, max_model_len) for _ in range(decodes)]
        prefill_contexts = [rng.randint(chunk, max_model_len) for chunk in chunks]
        return SimpleNamespace(decodes=decodes, prefills=prefills, num_seqs=decodes + prefills, num_tokens=tokens,
                               max_seqlen_q=max(chunks, default=1),
                               decode_max_seqlen_k=max(decode_contexts, default=0),
                               prefill_max_seqlen_k=max(prefill_contexts, default=0),
                               max_seqlen_k=max(decode_contexts + prefill_contexts))


@pytest.mark.parametrize("shapes", [H200_4B, H200_MOE_TP2], ids=["4b", "moe-tp2"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_the_warmup_plan_covers_every_configuration_of_served_steps_in_few_steps(shapes, graphs):
    plan = warmup_plan(shapes, graphs=graphs, **LIMITS)
    covered = set().union(*(step_keys(step, shapes) for step in plan))
    assert len(plan) <= 48
    rng = random.Random(7)
    for _ in range(2000):
        step = served_step(rng, graphs=graphs, **LIMITS)
        missing = step_keys(step, shapes) - covered
        assert not missing, f"{step} needs {missing}"
    # Pure decode steps replay CUDA graphs (compiled at capture); without graphs the plan runs them eagerly.
    assert any(step.prefills == 0 and step.decodes for step in plan) == (not graphs)


def test_every_planned_step_fits_the_engine_limits_and_brings_a_new_configuration():
    plan = warmup_plan(H200_4B, graphs=True, **LIMITS)
    covered = set()
    for step in plan:
        assert step.num_seqs <= LIMITS["max_num_seqs"] and step.num_tokens <= LIMITS["max_num_batched_tokens"]
        assert step.max_seqlen_k <= LIMITS["max_model_len"]
        keys = step_keys(step, H200_4B)
        assert not keys <= covered
        covered |= keys
        batch = warmup_batch(step, 16)
        assert len(batch.input_ids) == step.num_tokens and set(batch.state_slots) == {0}
        assert all(len(table) * 16 >= seq_len for table, seq_len in zip(batch.block_tables, batch.seq_lens))


@pytest.fixture
def compile_hook(monkeypatch):
    triton = pytest.importorskip("triton")
    from hybridkv.sidecar.execution import warmup

    # A fresh dispatcher: an engine an earlier test in this process dropped without closing keeps its counter in the
    # module's until the garbage collector takes it, and the hook would stay installed for it.
    monkeypatch.setattr(warmup, "_COMPILE_HOOK", warmup._CompileHook())
    previous = triton.knobs.runtime.jit_post_compile_hook
    calls = []
    triton.knobs.runtime.jit_post_compile_hook = lambda **kwargs: calls.append(kwargs["key"])
    yield triton, calls
    triton.knobs.runtime.jit_post_compile_hook = previous


def test_compiles_after_ready_are_counted_exported_and_the_earlier_hook_still_runs(compile_hook):
    from prometheus_client import generate_latest

    from hybridkv.sidecar.core.outputs import EngineStats
    from hybridkv.sidecar.serving.metrics import ServingMetrics

    triton, calls = compile_hook
    counter = JitCompileCounter()
    counter.install()
    hook = triton.knobs.runtime.jit_post_compile_hook
    hook(key="during-warmup", repr="kernel[warm]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    counter.mark_ready()
    hook(key="after-ready", repr="kernel[new shape]", fn=None, compile={}, is_manual_warmup=False,
         already_compiled=False)
    assert (counter.compiles_total, counter.compiles_after_ready) == (2, 1)
    assert calls == ["during-warmup", "after-ready"]
    frontend = SimpleNamespace(token_listeners=[], finish_listeners=[], timing_listeners=[], stats=EngineStats(
        0, 0, 0, 8, 0, 4, 0, 0, 0, jit_compiles_after_ready_total=counter.compiles_after_ready))
    text = generate_latest(ServingMetrics(frontend, "tiny").registry).decode()
    assert "hybridkv:jit_compiles_after_ready_total 1.0" in text
    # Uninstalled (the engine's close), the earlier hook is back and later compiles are not counted.
    counter.uninstall()
    triton.knobs.runtime.jit_post_compile_hook(key="after-close", repr="other[code]", fn=None, compile={},
                                               is_manual_warmup=False, already_compiled=False)
    assert counter.compiles_total == 2 and calls[-1] == "after-close"



def compile_event(hook, key: str) -> None:
    hook(key=key, repr=f"kernel[{key}]", fn=None, compile={}, is_manual_warmup=False, already_compiled=False)


def test_a_counter_dropped_without_uninstall_stops_counting_and_warning(compile_hook, caplog):
    """An engine dropped without `close()` (its counter marked ready) must not count, or warn about, the warm-up
    compiles of the next engine in the process: those are the next engine's, before its ready."""
    import gc

    triton, calls = compile_hook
    stale = JitCompileCounter()
    stale.install()
    stale.mark_ready()
    compile_event(triton.knobs.runtime.jit_post_compile_hook, "served-by-the-first")
    assert stale.compiles_after_ready == 1
    del stale
    gc.collect()
    fresh = JitCompileCounter()
    fresh.install()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridkv.sidecar.execution.warmup"):
        compile_event(triton.knobs.runtime.jit_post_compile_hook, "second-warmup")
    assert (fresh.compiles_total, fresh.compiles_after_ready) == (1, 0)
    assert not caplog.records
    assert calls == ["served-by-the-first", "second-warmup"]
    fresh.uninstall()
    assert triton.knobs.runtime.jit_post_compile_hook is not None
    compile_event(triton.knobs.runtime.jit_post_compile_hook, "after-close")
    assert fresh.compiles_total == 1 and calls[-1] == "after-close"


def test_two_live_counters_both_count_and_either_may_close_first(compile_hook):
    triton, calls = compile_hook
    original = triton.knobs.runtime.jit_post_compile_hook
    first, second = JitCompileCounter(), JitCompileCounter()
    first.install()
    second.install()
    compile_event(triton.knobs.runtime.jit_post_compile_hook, "both")
    first.uninstall()
    compile_event(triton.knobs.runtime.jit_post_compile_hook, "second-only")
    assert (first.compiles_total, second.compiles_total) == (1, 2)
    second.uninstall()
    assert triton.knobs.runtime.jit_post_compile_hook is original
    assert calls == ["both", "second-only"]


def greedy(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return [tokens[f"r{index}"] for index in range(len(prompts))]


def test_warmup_steps_touch_no_request_state_and_startup_phases_sum_to_the_time_to_ready(tiny_checkpoint):  # noqa: F811
    from hybridkv.sidecar.serving.server import model_info_to_proto

    from hybridkv.sidecar.core.config import EngineConfig
    from hybridkv.sidecar.core.engine import Engine

    prompts = [[3, 4, 5, 6], list(range(10, 60)), [9] * 7]
    config = EngineConfig(model=tiny_checkpoint, device="cpu", dtype="float32", max_num_seqs=4, max_model_len=256,
                          kv_cache_memory_bytes=8 * 1024**2, enforce_eager=True)
    started = time.perf_counter()
    engine = Engine(config)
    startup_s = time.perf_counter() - started
    expected = greedy(engine, prompts)
    phases = dict(engine.startup_phases)
    assert {"tokenizer", "weights", "memory profiling", "pool allocation"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) == pytest.approx(startup_s, rel=0.05, abs=0.02)
    info = model_info_to_proto(engine.model_info())
    assert [phase.name for phase in info.startup_phases] == [name for name, _ in engine.startup_phases]
    # The warm-up (run on CUDA at start-up) on the CPU engine: its steps use the null slot and block only.
    engine.warm_up()
    engine.check_invariants()
    assert greedy(engine, prompts) == expected
    assert engine.stats().jit_compiles_after_ready_total == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
# A W4A16 model too: its products take the CUDA-core kernels at decode sizes and the tensor-core tiles or the
# dequantized weight above, each a configuration the warm-up must reach. And Qwen3.5-35B-A3B's MoE layers (four
# layers of them): the experts' rows are aligned three ways by batch size, under three launch configurations.
@pytest.mark.parametrize("catalog_name,overrides,quantize", [("qwen3.5-0.8b", None, None),
                                                             ("qwen3.5-0.8b", None, "w4a16"),
                                                             ("qwen3.5-35b-a3b", {"num_hidden_layers": 4}, None)])
def test_random_prompt_lengths_and_batch_mixes_after_ready_compile_nothing(tmp_path, catalog_name, overrides,
                                                                           quantize):
    from hybridkv.sidecar.random_checkpoint import make_model
    from hybridkv.sizing import catalog_geometry

    folder = make_model(tmp_path, catalog_geometry(catalog_name), 0, overrides=overrides, dtype="bfloat16",
                        weights=False, quantize=quantize)
    engine = make_engine(str(folder), device="cuda", dtype="auto", load_format="random", enforce_eager=False,
                         kv_cache_memory_bytes=None, max_num_seqs=64, max_num_batched_tokens=2048,
                         max_model_len=4096)
    try:
        assert engine.jit_compiles.installed and engine.jit_compiles.ready
        rng = random.Random(3)
        vocab = engine.geometry.vocab_size
        for wave in range(6):
            for index in range(rng.randint(1, 64)):
                length = min(4000, max(1, int(rng.lognormvariate(5.0, 1.2))))
                engine.add_request(f"w{wave}-{index}", [rng.randrange(3, vocab) for _ in range(length)],
                                   SamplingParams(temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                                                  max_tokens=rng.randint(1, 48), ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
        assert engine.stats().jit_compiles_after_ready_total == 0
    finally:
        engine.close()


# The integer arguments of a launched kernel that follow the step (its tokens, rows, sequences and the tiles and blocks
# counted from them). Triton specializes an integer argument on whether it is 1 and whether 16 divides it, so each
# such argument left to specialize is up to three compiles the warm-up has to meet with steps of the right sizes.
STEP_COUNTS = frozenset({"M", "rows", "num_rows", "num_tokens", "num_seqs", "num_search_steps", "num_tiles",
                         "num_blocks", "num_chunks", "capture_count"})


def test_every_launched_kernel_takes_the_steps_counts_as_runtime_values():
    """A count left to specialize compiled a new `_norm_kernel` in a served run: a step whose first norm had a row
    count the warm-up's steps had not shown in that kernel's configuration."""
    import importlib
    import inspect
    import pkgutil

    triton = pytest.importorskip("triton")
    import hybridkv.kernels as kernels

    launched, specializing = [], []
    for module_info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"{kernels.__name__}.{module_info.name}")
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)
            if not (isinstance(value, triton.runtime.KernelInterface) and name.endswith("_kernel")
                    and getattr(fn, "__module__", None) == module.__name__):
                continue
            launched.append(name)
            # Compiled, a JITFunction has its parameters; interpreted (as the suite runs), the decorator's arguments.
            if hasattr(value, "params"):
                runtime_values = {param.name for param in value.params if param.do_not_specialize}
            else:
                runtime_values = set(value.kwargs.get("do_not_specialize") or ())
            specializing += [f"{name}({arg})" for arg in inspect.signature(fn).parameters
                             if arg in STEP_COUNTS and arg not in runtime_values]
    assert "_norm_kernel" in launched and "_paged_attention_kernel" in launched
    assert specializing == []
