"""Shared fixtures: `dist2` / `dist3` / `dist4` are session-wide pools of 2 / 3 / 4 gloo ranks (see launcher.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from launcher import RankPool  # noqa: E402


def _pool(world_size):
    pool = RankPool(world_size)
    yield pool
    pool.close(kill=True)


@pytest.fixture(scope="session")
def dist2():
    """RankPool of 2 ranks: `dist2.run(fn, *args)` -> [fn(rank, 2, *args) for each rank]."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def dist3():
    """RankPool of 3 ranks (a degree that divides few sizes): `dist3.run(fn, *args)`."""
    yield from _pool(3)


@pytest.fixture(scope="session")
def dist4():
    """RankPool of 4 ranks: `dist4.run(fn, *args)` -> [fn(rank, 4, *args) for each rank]."""
    yield from _pool(4)


# The default suite's slowest cases (pytest --durations, one full run: 15 to 85 s each on 2
# cores) that repeat, at a larger degree or another seed, a case the default suite runs; they run
# with `-m slow`, which keeps the default suite near 20 minutes on 2 cores.
SLOW_REPEATS = {
    "test_random_models.py::test_random_models_match_single_process[3]",
    "test_random_models.py::test_random_models_match_single_process[4]",
    "test_signatures.py::test_llama_with_and_without_labels[4]",
    "test_hf_face.py::test_save_pretrained_loads_in_one_process[4]",
    "test_sharded_outputs.py::test_llama_sharded_logits[dist4-4]",
    "test_uneven.py::test_heads_that_do_not_divide[4-qwen2-7-1-56]",
    "test_uneven.py::test_heads_that_do_not_divide[4-qwen2-6-2-48]",
    "test_uneven.py::test_hugging_face_odd_vocabulary[3-gpt2]",
    "test_kv_heads.py::test_gemma2_kv_heads_gathered_in_groups[eval]",
    "test_loading.py::test_from_pretrained_equals_hf[4]",
    "test_fused_parts.py::test_kv_heads_that_do_not_split_are_gathered_where_cut[10-kv-gathered-in-pairs]",
    "test_fused_parts.py::test_phi3_8_4_at_4_is_exact_and_checkpoints_across_degrees",
    "test_fused_parts.py::test_multi_query_kv_part_is_gathered_where_it_is_cut[4]",
    "test_any_model.py::test_models_equal_at_every_shape[4]",
    "test_fused.py::test_hugging_face_phi3_fused_projections[4]",
    "test_parallel_blocks.py::test_falcon_grouped_qkv_is_split_by_groups[4]",
    "test_engines.py::test_hf_export_at_4[llama]",
    # moved in a second round (each repeats a default case at another degree, model or layout)
    "test_blocks.py::test_fsdp2_trains_exactly[llama-layout4-checkpointed-init_device_mesh]",
    "test_kv_heads.py::test_gemma2_kv_heads_gathered_in_groups[train]",
    "test_kv_heads.py::test_query_heads_split_by_kv_group_checkpoint_across_degrees",
    "test_kv_heads.py::test_falcon_multi_query_heads_split_kv_gathered[4-sdpa]",
    "test_kv_heads.py::test_fewer_kv_heads_than_ranks[4-4-2-column_gather_groups]",
    "test_kv_heads.py::test_fewer_kv_heads_than_ranks[4-8-2-column_gather_groups]",
    "test_hf_models.py::test_hf_world4[qwen2]",
    "test_hf_models.py::test_hf_world4[llama]",
    "test_engines.py::test_hf_export_at_4[mistral]",
    "test_engines.py::test_dtensor_export_at_4[mistral]",
    "test_engines.py::test_dtensor_export_at_4[llama]",
    "test_uneven.py::test_hugging_face_odd_vocabulary[4-bert]",
    "test_partial_sums.py::test_embedding_sum_reduced_once[bert-4]",
    "test_parallel_blocks.py::test_parallel_blocks_are_exact_with_dropout[4]",
    "test_normal_forms.py::test_bloom_heads_split_through_batched_scores[4]",
    "test_mesh.py::test_two_d_checkpoints_reshard[2x2-4x1]",
    # mixtures of experts: the family each repeats runs in the default suite too (sequence parallel, 2 ranks)
    "test_moe.py::test_moe_exact[4-qwen2_moe-16-chosen-True]",
    "test_moe.py::test_moe_generates[qwen2_moe]",
    "test_moe.py::test_moe_predicted_peak_is_measured_peak[expert_tensor]",
    # the three slowest MoE cases (44-95 s each, at 3 and 4 ranks): both ways of splitting experts
    # run at 2 ranks by default (test_moe_exact[2-...], test_expert_layouts_exact)
    "test_moe.py::test_moe_exact[3-mixtral-8-expert_tensor-False]",
    "test_moe.py::test_moe_exact[4-deepseek_v3-8-expert_tensor-True]",
    "test_moe.py::test_moe_exact[3-qwen3_moe-16-expert_parallel-True]",
    # a third round (35-61 s each on a loaded machine): generation at 3 ranks runs by default in
    # test_greedy_world3_padded and at 4 in test_greedy_world4_kv_heads_held_by_groups; DTensor's
    # export at 4 in [llama_kv2], [gpt2], [mlp]; single-process masks at 2
    "test_generate.py::test_greedy_world3_fused_qkv",
    "test_generate.py::test_expanded_cache_world3",
    "test_generate.py::test_greedy_world3_per_head_key_norm",
    "test_engines.py::test_dtensor_export_at_4[qwen2]",
    "test_modes.py::test_single_process_masks_inside_attention[4]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if f"{item.path.name}::{item.name}" in SLOW_REPEATS:
            item.add_marker(pytest.mark.slow)
