"""Structure (not timing) tests of the planning benchmark on tiny configurations."""

from __future__ import annotations

import json

import pytest

import moriio_native as mn
from moriio_native.bench import planning

RESULT_KEYS = {
    "preset",
    "description",
    "context_tokens",
    "block_size",
    "blocks",
    "cache_blocks",
    "layers",
    "groups",
    "runs_emitted",
    "ours_mode",
    "ours_prepare_s",
    "ours_s_per_request",
    "ours_s_per_layer_request",
    "ours_ns_per_run",
    "python_s_per_request",
    "python_s_per_layer_request",
    "vllm_s_per_request",
    "vllm_s_per_layer_request",
    "speedup_vs_python",
    "speedup_vs_vllm",
    "convenience_ids_s_per_request",
    "convenience_pairs_s_per_request",
    "convenience_ids_speedup_vs_vllm",
    "convenience_pairs_speedup_vs_vllm",
    "matches_python",
    "matches_vllm",
}
TINY = {"min_time": 0.0, "min_reps": 1, "max_reps": 1, "baseline_layers": 1}


def _check_common(r: dict) -> None:
    assert set(r) == RESULT_KEYS
    assert r["matches_python"] is True
    assert r["ours_mode"] in ("pairs-once", "ids-per-layer")
    for key in (
        "ours_prepare_s",
        "ours_s_per_request",
        "ours_s_per_layer_request",
        "ours_ns_per_run",
        "python_s_per_request",
        "python_s_per_layer_request",
        "speedup_vs_python",
        "convenience_ids_s_per_request",
        "convenience_pairs_s_per_request",
    ):
        assert isinstance(r[key], float) and r[key] > 0, key
    assert r["ours_s_per_layer_request"] == pytest.approx(r["ours_s_per_request"] / r["layers"])
    assert r["ours_ns_per_run"] == pytest.approx(r["ours_s_per_request"] / r["runs_emitted"] * 1e9)
    assert r["speedup_vs_python"] == pytest.approx(
        r["python_s_per_request"] / r["ours_s_per_request"]
    )
    assert sum(g["layers"] for g in r["groups"]) == r["layers"]
    assert r["runs_emitted"] == sum(g["layers"] * g["runs_per_layer_request"] for g in r["groups"])
    for g in r["groups"]:
        # Fragmented ids: at most runs_per_block per block, at least one run per plane.
        assert 1 <= g["runs_per_layer_request"] <= g["runs_per_block"] * r["blocks"]


def test_tiny_run_without_vllm() -> None:
    results = planning.run_planning_bench(
        ["llama3-8b", "minimax-m3"], [64], cases=[("deepseek-v3", 128)], include_vllm=False, **TINY
    )
    assert [(r["preset"], r["context_tokens"]) for r in results] == [
        ("llama3-8b", 64),
        ("minimax-m3", 64),
        ("deepseek-v3", 128),
    ]
    for r in results:
        _check_common(r)
        assert r["vllm_s_per_request"] is None and r["vllm_s_per_layer_request"] is None
        assert r["speedup_vs_vllm"] is None and r["matches_vllm"] is None
    llama, minimax, deepseek = results
    # 64 tokens / block 16 = 4 blocks; 128 / 64 = 2 blocks; 64 / 64 = 1 block.
    assert (llama["blocks"], minimax["blocks"], deepseek["blocks"]) == (4, 1, 2)
    assert (llama["layers"], minimax["layers"], deepseek["layers"]) == (32, 124, 61)
    # [2,N,16,8,128] bf16: each plane of a block is one 16*8*128*2 = 32 KiB run -> 2 per block.
    # Latent [N,1,B,D]: a block is one run.
    assert [g["runs_per_block"] for g in llama["groups"]] == [2]
    assert [(g["name"], g["runs_per_block"]) for g in minimax["groups"]] == [
        ("dense", 2),
        ("indexer", 1),
    ]
    assert [g["runs_per_block"] for g in deepseek["groups"]] == [1]
    # One block per side: nothing can merge, so the runs are exactly the template's.
    assert minimax["runs_emitted"] == 62 * 2 + 62 * 1
    json.dumps(results)  # the CLI dumps these as JSON
    table = planning.format_table(results)
    for name in ("llama3-8b", "minimax-m3", "deepseek-v3"):
        assert name in table


def test_issue_cases_are_61_layers_8192_blocks() -> None:
    for name, ctx in planning.ISSUE_CASES:
        preset = planning.PRESETS[name]
        assert preset.num_layers == 61
        assert ctx // preset.block_size == 8192
    kinds = {planning.PRESETS[name].groups[0].kind for name, _ in planning.ISSUE_CASES}
    assert kinds == {"kv", "mla"}


def test_bad_arguments() -> None:
    with pytest.raises(mn.InvalidArgumentError, match="no-such-model"):
        planning.run_planning_bench(["no-such-model"], [64], include_vllm=False, **TINY)
    with pytest.raises(mn.InvalidArgumentError, match="positive"):
        planning.run_planning_bench(["llama3-8b"], [0], include_vllm=False, **TINY)


def test_main_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = planning.main(
        [
            "--presets",
            "deepseek-v3",
            "--contexts",
            "64",
            "--no-vllm",
            "--no-issue-cases",
            "--min-time",
            "0",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out) == 1 and out[0]["preset"] == "deepseek-v3" and out[0]["blocks"] == 1


def test_python_planner_matches_hand_numbers() -> None:
    # The baseline must plan like the engine. Worked example: [2,8,4,2,3] bf16 -> [2,16,4,2,3],
    # 1->4, 3->5: K (48,192) (144,240), V (432,960) (528,1008), 48 B each.
    spec = mn.CacheSpec(kind="kv", block_size=4, num_kv_heads=2, head_size=3, dtype_bytes=2)
    local = mn.describe_layer("l", mn.TensorGeometry([2, 8, 4, 2, 3], [192, 24, 6, 3, 1], 2), spec)
    remote = mn.describe_layer(
        "r", mn.TensorGeometry([2, 16, 4, 2, 3], [384, 24, 6, 3, 1], 2), spec
    )
    tmpl = planning.python_block_template(local, remote)
    assert tmpl.runs == [(0, 0, 48), (384, 768, 48)]
    assert planning.python_plan(tmpl, [3, 1], [5, 4]) == (
        [48, 144, 432, 528],
        [192, 240, 960, 1008],
        [48, 48, 48, 48],
    )
    # 1,2,3 -> 4,5,6 merges per plane: (48,192,144), (432,960,144).
    assert planning.python_plan(tmpl, [1, 2, 3], [4, 5, 6]) == ([48, 432], [192, 960], [144, 144])
    with pytest.raises(mn.InvalidArgumentError, match="longer than remote"):
        planning.python_plan(tmpl, [1, 2], [3])
    with pytest.raises(mn.InvalidArgumentError, match="duplicate"):
        planning.python_plan(tmpl, [1, 1], [3, 4])
    with pytest.raises(mn.OutOfRangeError, match="remote block id 16"):
        planning.python_plan(tmpl, [1], [16])
    with pytest.raises(mn.OutOfRangeError, match="local block id 8"):
        planning.python_plan(tmpl, [8], [1])


@pytest.mark.vllm
def test_tiny_run_with_vllm() -> None:
    pytest.importorskip("vllm")
    if planning.vllm_planner() is None:
        pytest.skip("vLLM's MoRIIO layout module cannot be imported")
    results = planning.run_planning_bench(
        ["llama3-8b", "minimax-m3"], [128], cases=[("deepseek-v3", 256)], **TINY
    )
    for r in results:
        _check_common(r)
        # vLLM's own offsets are identical to ours for these layouts.
        assert r["matches_vllm"] is True
        assert isinstance(r["vllm_s_per_request"], float) and r["vllm_s_per_request"] > 0
        assert r["speedup_vs_vllm"] == pytest.approx(
            r["vllm_s_per_request"] / r["ours_s_per_request"]
        )
