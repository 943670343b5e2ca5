"""The MoE hybrids against transformers: Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`) and Qwen3-Next
(`Qwen3NextForCausalLM`) on tiny random checkpoints, in float32 on CPU.

Three checkpoints: Qwen3.5-MoE as make_model writes it (stacked 3-D experts, as the published checkpoints store them),
the same weights as transformers' `save_pretrained` writes them (one tensor per expert), and Qwen3-Next (per-key-head
fused GDN projections, per-expert tensors, layer 1 dense through `mlp_only_layers`). Bounds are the dense model's:
greedy tokens identical, logits within `LOGITS_ATOL` = 1e-3 (their standard deviation is about 8). The engine
scenario (chunked prefill, preemption) at tp 1 and 2 and the gloo rank shards at tp 4 use the same checkpoints.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
import torch.multiprocessing as mp
import test_sidecar_model as dense
import test_sidecar_tp as tp_scenario
from safetensors.torch import load_file, save_file
from sidecar_model_harness import TF32_SPREADS, HfReference, PagedHarness, load_model, tf32_spread

from hybridkv.sidecar.model.loader import CheckpointError
from hybridkv.sidecar.model.moe import SparseMoeBlock
from hybridkv.sidecar.model.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MLP, UnsupportedModelError
from hybridkv.sidecar.random_checkpoint import checkpoint_shapes, make_model
from hybridkv.sizing import catalog_geometry, geometry_from_config

CHECKPOINT_SEED = 5
MOE_CATALOG = ("qwen3.5-35b-a3b", "qwen3-next-80b-a3b")


def _make(folder, catalog_name, **overrides):
    make_model(folder, catalog_geometry(catalog_name), CHECKPOINT_SEED, tiny=True, dtype="float32",
               overrides=overrides or None)
    return folder


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("tiny-qwen3.5-moe"), "qwen3.5-35b-a3b")


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("tiny-qwen3-next"), "qwen3-next-80b-a3b", mlp_only_layers=[1])


@pytest.fixture(scope="module")
def qwen3_5_moe_wide_shared_expert(tmp_path_factory):
    """A shared expert twice as wide as a routed one: it cannot be stacked with them and runs as its own SwiGLU."""
    return _make(tmp_path_factory.mktemp("tiny-qwen3.5-moe-wide-shared"), "qwen3.5-35b-a3b",
                 shared_expert_intermediate_size=64)


@pytest.fixture(scope="module")
def hf_saved_qwen3_5_moe(qwen3_5_moe, tmp_path_factory):
    """The Qwen3.5-MoE weights as transformers itself writes them, from a model it built (a model it loaded would be
    written back in the layout it was read from)."""
    folder = tmp_path_factory.mktemp("tiny-qwen3.5-moe-saved-by-transformers")
    loaded = HfReference(qwen3_5_moe).model
    built = type(loaded)(loaded.config)
    built.load_state_dict(loaded.state_dict())
    built.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["qwen3.5-moe", "qwen3.5-moe-saved-by-transformers", "qwen3-next",
                                        "qwen3.5-moe-wide-shared-expert"])
def pair(request, qwen3_5_moe, qwen3_next):
    folder = {"qwen3.5-moe": lambda: qwen3_5_moe, "qwen3-next": lambda: qwen3_next,
              "qwen3.5-moe-saved-by-transformers": lambda: request.getfixturevalue("hf_saved_qwen3_5_moe"),
              "qwen3.5-moe-wide-shared-expert": lambda: request.getfixturevalue("qwen3_5_moe_wide_shared_expert")}
    folder = folder[request.param]()
    return dense.Pair(load_model(folder), HfReference(folder), dense.LOGITS_ATOL)


def test_transformers_writes_one_tensor_per_expert_and_the_checkpoints_differ_only_in_layout(
        qwen3_5_moe, hf_saved_qwen3_5_moe):
    saved = load_file(hf_saved_qwen3_5_moe / "model.safetensors")
    ours = load_file(qwen3_5_moe / "model.safetensors")
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in saved and "model.layers.0.mlp.experts.gate_up_proj" in ours
    stacked = ours["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(saved["model.layers.0.mlp.experts.7.up_proj.weight"], stacked[7, stacked.shape[1] // 2 :])


def test_mixed_prefill_and_decode_batches_follow_transformers_greedy(pair, torch_generator):
    """Decodes and prefill chunks in one batch (chunks split mid-prompt), 10 greedy tokens per sequence."""
    dense.test_decodes_and_prefill_chunks_in_one_batch_follow_transformers_greedy(pair, torch_generator)


def test_prompt_split_into_chunks_gives_the_whole_prompts_logits(pair, torch_generator):
    dense.test_prompt_split_into_chunks_gives_the_whole_prompts_logits(pair, torch_generator)


def test_the_shared_expert_loads_as_the_last_expert_of_the_stack_when_it_is_as_wide(qwen3_5_moe,
                                                                                     qwen3_5_moe_wide_shared_expert):
    """Its checkpoint tensors (`mlp.shared_expert.*`) fill slot E of the stacked experts, byte for byte; a wider
    shared expert stays a SwiGLU MLP of its own."""
    model = load_model(qwen3_5_moe)
    block = model.model.layers[0].mlp
    stored = load_file(str(next(qwen3_5_moe.glob("*.safetensors"))))
    num_experts = block.router.weight.shape[0] - 1
    assert block.shared_expert is None and block.experts.gate_up_proj.shape[0] == num_experts + 1
    prefix = "model.layers.0.mlp"
    assert torch.equal(block.experts.gate_up_proj[num_experts], torch.cat(
        [stored[f"{prefix}.shared_expert.gate_proj.weight"], stored[f"{prefix}.shared_expert.up_proj.weight"]]))
    assert torch.equal(block.experts.down_proj[num_experts], stored[f"{prefix}.shared_expert.down_proj.weight"])
    assert torch.equal(block.experts.down_proj[:num_experts], stored[f"{prefix}.experts.down_proj"])
    wide = load_model(qwen3_5_moe_wide_shared_expert).model.layers[0].mlp
    assert isinstance(wide.shared_expert, Qwen3_5MLP) and wide.experts.gate_up_proj.shape[0] == num_experts


def test_layers_the_config_keeps_dense_have_a_dense_mlp(qwen3_next):
    geometry = geometry_from_config(json.loads((qwen3_next / "config.json").read_text()))
    model = Qwen3_5ForCausalLM(geometry, torch.float32, "meta")
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock, Qwen3_5MLP, SparseMoeBlock, SparseMoeBlock]
    sparse_step = Qwen3_5ForCausalLM(geometry_from_config({**geometry_config(qwen3_next), "mlp_only_layers": [],
                                                           "decoder_sparse_step": 2}), torch.float32, "meta")
    assert [type(layer.mlp) for layer in sparse_step.model.layers] == [Qwen3_5MLP, SparseMoeBlock] * 2


def geometry_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("catalog_name", MOE_CATALOG)
def test_each_rank_holds_exactly_the_weight_bytes_the_planner_predicts(catalog_name, tp_size):
    geometry = catalog_geometry(catalog_name)
    for rank in range(tp_size):
        model = Qwen3_5ForCausalLM(geometry, torch.bfloat16, "meta", tp_rank=rank, tp_size=tp_size)
        assert sum(p.numel() * p.element_size() for p in model.parameters()) == geometry.weights_bytes(tp_size)


@pytest.mark.parametrize("catalog_name,expert_tensor,shape", [
    ("qwen3.5-35b-a3b", "model.layers.39.mlp.experts.gate_up_proj", (256, 1024, 2048)),
    ("qwen3-next-80b-a3b", "model.layers.47.mlp.experts.511.down_proj.weight", (2048, 512)),
])
def test_full_size_checkpoints_use_the_published_names_and_shapes(catalog_name, expert_tensor, shape):
    geometry = catalog_geometry(catalog_name)
    from hybridkv.sidecar.random_checkpoint import build_config

    shapes = checkpoint_shapes(build_config(geometry))
    assert shapes[expert_tensor] == shape
    assert sum(torch.Size(s).numel() for s in shapes.values()) == geometry.num_parameters()


def test_qwen3_5_moe_without_renormalised_routing_is_refused():
    geometry = geometry_from_config({**catalog_config("qwen3.5-35b-a3b"), "norm_topk_prob": False})
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob=false is not supported for qwen3_5_moe_text"):
        Qwen3_5ForCausalLM(geometry, torch.bfloat16, "meta")


def catalog_config(name: str) -> dict:
    from hybridkv.sidecar.random_checkpoint import config_from_geometry

    return config_from_geometry(catalog_geometry(name))


# ---- loading ---------------------------------------------------------------------------------------------------


def rewrite(source, target, edit):
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps(config))


def prompt_logits(folder) -> torch.Tensor:
    return PagedHarness(load_model(folder)).step([("s", list(range(40, 80)))])


def test_an_expert_missing_from_a_per_expert_checkpoint_is_named(hf_saved_qwen3_5_moe, tmp_path):
    rewrite(hf_saved_qwen3_5_moe, tmp_path / "bad", lambda tensors, _: tensors.pop(
        "model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight$"):
        load_model(tmp_path / "bad")


def test_experts_stored_both_stacked_and_per_expert_are_refused(qwen3_5_moe, hf_saved_qwen3_5_moe, tmp_path):
    per_expert = load_file(hf_saved_qwen3_5_moe / "model.safetensors")

    def add_one_expert(tensors, _):
        tensors["model.layers.0.mlp.experts.3.down_proj.weight"] = per_expert[
            "model.layers.0.mlp.experts.3.down_proj.weight"]

    rewrite(qwen3_5_moe, tmp_path / "both", add_one_expert)
    with pytest.raises(CheckpointError, match=r"stored more than once: model\.layers\.0\.mlp\.experts\.3\.down_proj"):
        load_model(tmp_path / "both")


def test_a_missing_stacked_expert_tensor_is_named_once(qwen3_5_moe, tmp_path):
    rewrite(qwen3_5_moe, tmp_path / "bad", lambda tensors, _: tensors.pop("model.layers.1.mlp.experts.down_proj"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.mlp\.experts\.down_proj$"):
        load_model(tmp_path / "bad")


def test_vision_language_and_mtp_tensors_are_skipped_with_a_log_line(qwen3_5_moe, tmp_path, caplog):
    """Qwen3.5-MoE's published layout: the text model under model.language_model, a vision tower, MTP layers."""

    def to_vision_language(tensors, config):
        for name in list(tensors):
            tensors["model.language_model." + name[len("model."):] if name.startswith("model.") else name] = \
                tensors.pop(name)
        tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(12, 4)
        tensors["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.ones(4, 8)
        tensors["mtp.fc.weight"] = torch.ones(4, 8)
        text_config = dict(config)
        config.clear()
        config.update(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"],
                      text_config=text_config, vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 32})

    rewrite(qwen3_5_moe, tmp_path / "vl", to_vision_language)
    with caplog.at_level(logging.INFO, logger="hybridkv.sidecar.model.loader"):
        logits = prompt_logits(tmp_path / "vl")
    assert torch.equal(logits, prompt_logits(qwen3_5_moe))
    assert "skipping 1 vision-tower tensors (model.visual.*)" in caplog.text
    assert "skipping 2 multi-token-prediction tensors (mtp.*)" in caplog.text


# ---- the engine (chunked prefill, preemption) and tensor parallelism -------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_name", ["qwen3.5-moe", "qwen3-next"])
def test_engine_greedy_tokens_with_chunked_prefill_and_preemption_equal_transformers_at_tp_1_and_2(
        checkpoint_name, qwen3_5_moe, qwen3_next):
    folder = str(qwen3_5_moe if checkpoint_name == "qwen3.5-moe" else qwen3_next)
    reference = HfReference(folder)
    prompts = tp_scenario.scenario_prompts()
    expected = [reference.greedy(prompt, tp_scenario.MAX_TOKENS)[0] for prompt in prompts]
    for tp in (1, 2):
        engine = tp_scenario.start_engine(folder, tp)
        try:
            tokens, _, preemptions = tp_scenario.run_scenario(engine)
        finally:
            engine.close()
        assert preemptions > 0, "the scenario must force preemption"
        assert tokens == expected, f"tp={tp}"


@pytest.mark.slow
def test_four_tensor_parallel_ranks_produce_the_single_rank_logits(qwen3_next, torch_generator):
    """Every expert's 32 intermediate features split 8 per rank, one GDN key head per rank (tp 2, stacked and
    per-expert layouts, is the engine test above)."""
    tp_size = 4
    prompts = [dense.random_prompt(torch_generator, length) for length in (9, 20, 75)]
    expected = dense._tp_scenario(load_model(qwen3_next), prompts)
    with mp.Manager() as manager:
        results = manager.dict()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(dense._tp_worker, args=(tp_size, dense._free_port(), str(qwen3_next), prompts, results),
                 nprocs=tp_size, join=True)
        per_rank = [results[rank] for rank in range(tp_size)]
    for rank, logits in enumerate(per_rank):
        dense.assert_logits_close(logits, expected, f"tp={tp_size} rank {rank}")
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))


# ---- weights built in device memory (the full-size benches) ------------------------------------------------------


def _random_weights_pair(folder, device: str, dtype: torch.dtype, seed: int = 3):
    """The engine's model, then transformers', each filled in place from the same seed; one at a time holds the
    device (two full-size bf16 copies do not fit on one GPU), so the engine's logits are taken first. Returns both
    logits and how far TF32 matmuls move transformers' own (0.0 off CUDA)."""
    import gc

    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridkv.sidecar.random_weights import fill_engine_model, fill_transformers_model

    config = geometry_config(folder)
    prompt = list(range(100, 140))
    model = Qwen3_5ForCausalLM(geometry_from_config(config), dtype, device)
    fill_engine_model(model, config, seed)
    ours = PagedHarness(model, num_blocks=16, block_size=16).step([("s", prompt)])
    del model
    gc.collect()
    with torch.device(device):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype).eval()
    fill_transformers_model(reference, config, seed)

    def reference_logits():
        with torch.no_grad():
            return reference(torch.tensor([prompt], device=device)).logits[0].float().cpu()

    if device == "cpu":
        return ours, reference_logits(), 0.0
    return (ours, *tf32_spread(reference_logits))


def test_weights_built_in_memory_are_the_same_for_the_engine_and_transformers(tmp_path):
    folder = make_model(tmp_path, catalog_geometry("qwen3.5-35b-a3b"), 0, tiny=True, dtype="float32", weights=False)
    assert not list(folder.glob("*.safetensors"))
    from sidecar_model_harness import transformers_without_fla

    with transformers_without_fla("qwen3_5_moe_text"):
        ours, theirs, _ = _random_weights_pair(folder, "cpu", torch.float32)
    dense.assert_logits_close(ours, theirs, "random weights built in memory")
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.gpu
def test_full_width_qwen3_5_35b_a3b_layers_against_transformers_on_one_gpu(tmp_path):
    """Every dimension of Qwen3.5-35B-A3B (256 experts, top 8, the shared expert, the full vocabulary) in four layers,
    three GDN and one attention, in float32 on both sides. The 40-layer random stack is no oracle: in bf16 its logits
    differed from transformers' by 66% of their norm (measured on an H200), as random stacks amplify rounding (see
    random_checkpoint). The engine's float32 dots run in TF32 like transformers' with TF32 on, two independent
    roundings of the same sums: the bound is TF32_SPREADS times what TF32 moves transformers' own logits, or
    GPU_LOGITS_ATOL."""
    torch.backends.cuda.matmul.allow_tf32 = False
    folder = make_model(tmp_path, catalog_geometry("qwen3.5-35b-a3b"), 0, weights=False,
                        overrides={"num_hidden_layers": 4})
    ours, theirs, spread = _random_weights_pair(folder, "cuda", torch.float32)
    atol = max(dense.GPU_LOGITS_ATOL, TF32_SPREADS * spread)
    print(f"max |logit difference| {(ours - theirs).abs().max().item():.3g}, transformers' own TF32 spread "
          f"{spread:.3g}")
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


@pytest.mark.large_memory
def test_full_width_qwen3_5_35b_a3b_layers_against_transformers_on_cpu(tmp_path):
    """The same full-width model in two layers (one GDN, one attention) on CPU, where both sides compute in exact
    float32 on the reference kernels (about 15 GB at the peak: one model at a time), so the bound is the CPU one."""
    folder = make_model(tmp_path, catalog_geometry("qwen3.5-35b-a3b"), 0, weights=False,
                        overrides={"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]})
    from sidecar_model_harness import transformers_without_fla

    with transformers_without_fla("qwen3_5_moe_text"):
        ours, theirs, _ = _random_weights_pair(folder, "cpu", torch.float32)
    dense.assert_logits_close(ours, theirs, "full-width layers")
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton interpreter is off on a CUDA machine; there "
                    "tests/test_kernels_moe.py's GPU tests hold the router and the fused MoE with the shared expert "
                    "against the reference")
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("checkpoint", ["qwen3_5_moe", "qwen3_5_moe_wide_shared_expert"])
def test_the_moe_block_through_the_triton_kernels_matches_the_reference(checkpoint, num_tokens, request, monkeypatch,
                                                                         torch_generator):
    """The router and the fused MoE with the shared expert as the stack's last expert (one token routed inside
    both of its kernels), or (wider than a routed one) added in the final reduction, through the Triton interpreter
    against the plain-torch path of the same block."""
    pytest.importorskip("triton")
    model = load_model(request.getfixturevalue(checkpoint))
    block = next(module for module in model.modules() if isinstance(module, SparseMoeBlock))
    assert (block.shared_expert is None) == (checkpoint == "qwen3_5_moe")
    hidden = torch.randn(num_tokens, block.router.weight.shape[1], generator=torch_generator)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    want = block(hidden)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")  # the interpreter: conftest sets TRITON_INTERPRET on CPU
    got = block(hidden)
    assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5)
