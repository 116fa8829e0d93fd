"""Smoke tests: the demo and each benchmark run for a few steps, as a user would run them."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args, cwd=ROOT):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    r = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_sharding_demo():
    out = run("examples/sharding_demo.py", "--steps", "3")
    placed = re.search(r"fullest device holds (.*) \(plan: (.*)\)", out)
    assert placed and placed.group(1) == placed.group(2), out
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "still P(None, 'fsdp') after training" in out


def test_finetune_hf_example(tmp_path):
    pytest.importorskip("tunix")
    out = run("examples/finetune_hf/finetune.py", "--steps", "4", "--workdir", str(tmp_path))
    assert "resumed from step 2 on 4 devices" in out
    assert (tmp_path / "merged" / "config.json").is_file()
    assert (tmp_path / "peft" / "adapter_config.json").is_file()


def test_lora_example(tmp_path):
    out = run("examples/lora/finetune.py", "--steps", "6", "--workdir", str(tmp_path))
    figures = json.loads(out[out.rindex("\n{") + 1 :])
    assert figures["logits_vs_numpy_max_diff"] < 1e-4  # the load is right, not just shaped right
    assert figures["load_bytes_read_over_needed"] == 1.0
    assert figures["eval_loss_after"] < figures["eval_loss_before"]
    assert figures["resumed_from_step"] == 3 and figures["export_vs_tuned_logits_max_diff"] < 1e-4
    assert 0 < figures["trainable_bytes"] < figures["frozen_bytes"]


def check_infer(result):
    assert result["jax_arrays_allocated"] == 0
    assert result["leaves"] == 4 * 16 * 4 + 2  # model, mu, nu, EMA per layer, + count and step
    # 6 kernels under anchored rules, in the model, adam mu and nu, and the EMA.
    assert result["leaves_matched_by_parameter_path"] == 4 * 6 * 4


def check_init(result):
    ours, base = result["runs"]["create_sharded"], result["runs"]["init_then_device_put"]
    assert ours["checksum"] == base["checksum"]
    assert ours["live_bytes_fullest_device"] == ours["plan_bytes_per_device"]
    assert ours["mu_spec"] == "P(None, 'fsdp')"


def check_reshard(result):
    ours = result["runs"]["nnx_shard.reshard"]
    assert ours["goes_through_host"] is False
    assert ours["bytes_moved"] == ours["ideal_bytes"]
    assert 0 <= ours["measured_transient_bytes_per_device"] <= ours["peak_bytes_per_device"]
    assert result["runs"]["host round trip"]["goes_through_host"] is True


def check_resize(result):
    assert result["all_bitwise_equal"] is True
    ours = result["runs"]["nnx_shard on_mesh_change"]
    assert ours["cold"]["to_4"]["bytes_moved"] == ours["cold"]["to_4"]["ideal_bytes"] > 0
    assert ours["cold"]["to_4"]["report"].startswith("moved from 8 devices (fsdp=8) to 4 devices (fsdp=4)")
    assert ours["cold"]["to_4"]["fullest_device_after_bytes"] == ours["cold"]["to_4"]["plan_bytes_per_device"]


def ratio_of(r, ratio, ours, base):
    """A reported ratio is finite and is the ratio of the two reported figures (as rounded in the JSON)."""
    assert 0 < r[ours] < float("inf") and 0 < r[base] < float("inf"), (r[ours], r[base])

    def half_unit(x):  # the rounding of a figure written with d decimals
        return 0.5 * 10.0 ** -len(repr(float(x)).split(".")[1]) if "e" not in repr(float(x)) else 0.0

    lo = (r[ours] - half_unit(r[ours])) / (r[base] + half_unit(r[base]))
    hi = (r[ours] + half_unit(r[ours])) / (r[base] - half_unit(r[base]))
    assert lo * (1 - 2e-3) <= r[ratio] <= hi * (1 + 2e-3), (ratio, r[ratio], r[ours], r[base])


def check_guard(r):
    ratio_of(r, "ratio", "step_ms_cond", "step_ms_no_check")
    ratio_of(r, "ratio_select", "step_ms_select", "step_ms_no_check")
    assert r["temp_bytes_cond"] is not None
    # the same finite steps from the same state, with and without the check: the same parameters
    assert r["max_param_diff_cond_vs_no_check"] < 1e-5 and r["max_param_diff_select_vs_no_check"] < 1e-5


def check_idioms(r):
    ratio_of(r, "step_ratio", "step_ms_explicit", "step_ms_auto")
    ratio_of(r, "restore_ratio", "restore_s_ours", "restore_s_orbax")
    assert r["restored_equal_to_orbax"] is True and r["restore_bytes"] > 0


def check_step(result):
    ratio_of(result, "ratio", "trainer_step_ms", "hand_jit_step_ms")
    assert result["max_param_diff_vs_hand"] < 1e-5  # the same steps as the hand-written loop
    tiny = result["host_bound"]  # a step that is all dispatch, on one device: the host's work per step
    ratio_of(tiny, "ratio", "trainer_step_ms", "hand_jit_step_ms")
    assert abs(tiny["host_overhead_ms"] - (tiny["trainer_step_ms"] - tiny["hand_jit_step_ms"])) < 1e-3
    # a train() call's fixed work, apart from the marginal step (TensorBoard's file stays open across calls)
    # (a difference of timings: its sign is noise on a loaded machine, so only its presence is checked)
    assert math.isfinite(tiny["train_call_fixed_ms"])


def check_restore(result):
    ours = result["runs"]["nnx_shard"]
    assert ours["kernel_mesh"] == {"fsdp": 4}
    assert ours["report"] == "restored step 1, saved on 8 devices (fsdp=8), onto 4 devices (fsdp=4)"
    # every variant restores the same values (the kernel's checksum), and the ratios are finite
    assert len({run["checksum"] for run in result["runs"].values()}) == 1, result["runs"]
    assert 0 < result["time_ratio_vs_orbax"] < float("inf") and 0 < result[
        "budget_time_ratio_vs_orbax"
    ] < float("inf")


def check_vit(result):
    assert result["mesh"] == "fsdp=8"
    speed = {"ours": 1 / result["trainer_images_per_s"], "base": 1 / result["hand_jit_images_per_s"]}
    ratio_of({**result, **speed}, "ratio_trainer_time_over_hand", "ours", "base")
    # Not bitwise: adamw turns float noise in the ViT's near-zero gradients into updates of up to the
    # rate (1e-3) a step, so 9 steps bound the difference by 9e-3 (2.3e-3 measured at 8).
    assert result["max_param_diff_vs_hand"] < 9e-3
    # each first call's compile split into JAX's phases: the Trainer's step compiled in its first call (none
    # at init but the creation's), the hand-written step in its own
    phases = result["compile_phases_s"]
    for first in ("trainer_first_call", "hand_jit_first_step", "trainer_init"):
        assert phases[first]["backend_compile"] > 0 and phases[first]["jaxpr_trace"] > 0, phases


def check_load(result):
    # every byte a shard needs read once, none twice; the figures are finite ratios
    assert result["stream"]["bytes"] == result["stream"]["bytes_needed"] == result["stream"]["state_bytes"]
    assert result["stream_bytes_read_over_needed"] == 1.0
    assert 0 < result["stream_rate_over_read_rate"] < float("inf") and result["stream_within_rss_goal"]


def check_tpu(result):
    (compiled,) = result["compiles"]  # the tiny ViT on v5e:2x4
    assert compiled["fits"] is True and compiled["devices"] == 8 and compiled["flops"] > 0
    assert compiled["peak_bytes"] >= compiled["argument_bytes"] >= compiled["state_bytes"] > 0
    move = result["reshard"]
    assert move["bytes_moved"] == move["ideal_bytes"] > 0 and move["never_whole"] is True


def check_create(result):
    median = result["median"]
    assert 0 < median["baseline_eval_shape_s"] < median["baseline_s"] and median["compile_s"] > 0
    want = round(median["create_sharded_s"] / median["baseline_s"], 3)
    assert abs(result["ratio_create_sharded_vs_baseline"] - want) <= 2e-3  # its figures, as rounded


def check_suggest(result):
    (vit,) = result["compiled"]  # the tiny ViT on 8 CPU devices, at half the replicated state's bytes
    hand, budget = vit["hand_layouts"], vit["budget_bytes"]
    best = min(h["sent_bytes"] for h in hand.values() if h["state_bytes"] <= budget)
    assert vit["sent_ratio_to_best_hand"] == round(vit["suggestion"]["sent_bytes"] / best, 3) <= 1.05
    assert vit["suggestion"]["state_bytes"] <= budget < hand["everything replicated"]["state_bytes"]
    if "speed" in result:  # with libtpu: suggested on v5e:2x4, no compile
        assert all(v["suggest_seconds"] > 0 for k, v in result["speed"].items() if k.endswith("layers"))


def check_resize_hosts(result):
    # off process 1's devices and back: each byte the plan names sent once, process 1 left holding nothing,
    # every leaf bitwise after both variants' round trips
    assert result["bytes_moved_over_ideal"] == 1.0
    assert result["process_1_shards_while_off"] == 0
    assert result["bitwise_equal"] is True
    assert result["warm_ratio_vs_through_host"] > 0
    # a save while off copies the state onto the whole mesh first: both saves timed, the copy inside one
    saves = result["save_s"]
    assert 0 < saves["copy"] < saves["while_off"] and saves["on_whole_mesh"] > 0


def check_gpu(result):
    # the quick parts, each in its own process, on 2 CPU devices here: nothing failed, the values agree bit
    # for bit (sharded creation with init-then-place, both restores with the save), and the compile report
    # has the step's peak; the CPU keeps no allocator statistics, so that comparison is left out, not faked
    parts, summary = result["parts"], result["summary"]
    assert all("error" not in p for p in parts.values()), parts
    assert summary["same_values_as_eager_init"] is True and summary["same_values_as_plain_jit_init"] is True
    assert summary["restore_same_values"] is True
    assert summary["step_compile_s"] > 0
    verified = parts["restore_nnx_shard"]["verify_s"]  # the verification's seconds, read from the log
    assert len(verified) == 3 and all(v >= 0 for v in verified)
    for phase in ("structure_s", "orbax_read_s"):  # where each read's time goes, from the log
        assert (
            len(parts["restore_nnx_shard"][phase]) == len(parts["restore_nnx_shard_unverified"][phase]) == 3
        )
    assert parts["restore_nnx_shard"]["compile_wait_s"] == []  # CPUs compile no fingerprint program ahead
    assert (
        parts["restore_orbax"]["next_compile_s"] > 0 and summary["restore_and_next_compile_over_orbax_s"] > 0
    )
    assert len(parts["saves"]["fingerprint_s"]) == 6  # each of our saves fingerprinted, its seconds logged
    step = parts["step"]
    assert step["compile_report"]["peak_bytes"] >= step["compile_report"]["state_bytes"] > 0
    assert summary["trainer_over_hand_jit"] > 0 and summary["restore_over_orbax_s"] > 0
    # one more step within a call, apart from a call's fixed work (a difference of timings: its sign is
    # noise on a loaded machine)
    marginal = step["trainer_step_marginal_ms"] / step["hand_jit_step_marginal_ms"]
    assert step["marginal_ratio"] == pytest.approx(marginal, rel=0.01, abs=1e-3)
    assert (
        math.isfinite(step["train_call_fixed_ms"])
        and summary["train_call_fixed_ms"] == step["train_call_fixed_ms"]
    )
    # the hand-written step with the Trainer's additions one by one, each timed
    assert all(step[f"hand_jit_with_grad_norm{k}_ms"] > 0 for k in ("", "_and_cond", "_and_select"))
    assert (
        parts["create_sharded"]["memory_stats"] is None
        and summary["allocator_peak_over_compile_report"] is None
    )
    # the ViT example's sharded init compiled as shipped and through plain jax.jit (JAX's default threefry
    # lowering; the kernel is a GPU lowering, so the CPU compiles the same program); a tiny init's bits
    # compared both ways, and the user's flag untouched by the call
    shipped, inlined = parts["vit_init"], parts["vit_init_inlined"]
    assert shipped["arrays"] == inlined["arrays"] > 0 and shipped["platform"] == "cpu"
    assert shipped["user_flag_after"] is False and inlined["user_flag_after"] is False
    assert summary["vit_init_compile_s"] == [shipped["compile_s"], inlined["compile_s"]]
    assert summary["init_same_bits"] is True and summary["init_user_flag_unchanged"] is True
    assert parts["init_bits"]["arrays"] > 0
    # the step's compile split into JAX's phases (tracing, lowering, XLA's compile): what dominates it
    assert set(step["step_compile_phases_s"]) >= {"jaxpr_trace", "jaxpr_to_mlir_module", "backend_compile"}
    # snapshots every 10 and 100 against none, and what the stage programs read and write
    snaps = parts["snapshots"]
    assert summary["snapshot_ratio"] == {"10": snaps["every_10"]["ratio"], "100": snaps["every_100"]["ratio"]}
    assert snaps["every_10"]["taken"] > 0 and summary["snapshot_stage_bytes_over_one_read_and_write"] >= 1.0
    # one snapshot's milliseconds on the step's path and in the background, timed from outside
    assert summary["snapshot_ms"] == [
        snaps["snapshot_ms_on_the_steps_path"],
        snaps["snapshot_ms_in_the_background"],
    ]
    assert snaps["snapshot_ms_on_the_steps_path"] > 0


def check_snapshot(r):
    # the median of the rounds' ratios (each round against the Trainer without snapshots in that round)
    rounds = r["ratios_every_10_by_round"]
    assert all(x > 0 for x in rounds) and r["ratio_every_10"] == pytest.approx(
        statistics.median(rounds), abs=1e-3
    )
    assert r["step_ms_every_10"] > 0 and r["step_ms_no_snapshot"] > 0
    assert r["snapshot_bytes_per_process"] > 0 and r["snapshots_taken_every_1"] > 0
    assert r["snapshot_ms_on_the_steps_path"] > 0 and r["snapshot_ms_in_the_background"] >= 0
    # XLA's bytes accessed by the stage programs (a GPU's and a TPU's first move): at least a read and a write
    assert r["stage_bytes_over_one_read_and_write"] >= 1.0
    # two processes: the copy to the peer, what starting a snapshot and sending its copy cost a step
    two = r["two_processes"]
    assert two["ratio_every_10"] == pytest.approx(statistics.median(two["by_round"]), abs=1e-3)
    assert set(two["median_ms"]) == {"write", "poll"} and all(v > 0 for v in two["median_ms"].values())


def check_recovery(r):
    # the same kill, recovered from the last checkpoint and from the in-memory snapshots: the snapshot run
    # resumes from a newer step (snapshots every 2 steps, checkpoints every 4), with each phase timed
    ckpt, snap = r["checkpoint"], r["snapshot"]
    assert ckpt["source"] == "checkpoint" and snap["source"] == "snapshot"
    assert snap["restored_step"] > ckpt["restored_step"] and snap["steps_lost"] < ckpt["steps_lost"]
    assert snap["snapshot_bytes_per_process"] > 0 == ckpt["snapshot_bytes_per_process"]
    for run in (ckpt, snap):
        phases = ("detection_s", "relaunch_s", "read_reshard_s", "compile_s", "first_step_s")
        assert run["death_to_first_step_s"] == pytest.approx(sum(run[p] for p in phases), abs=2e-3)
    assert r["ratio_death_to_first_step"] == pytest.approx(
        snap["death_to_first_step_s"] / ckpt["death_to_first_step_s"], abs=1e-3
    )


def check_bucket(r):
    # the emulated bucket: both sides wrote and read every round, and each ratio is a real figure
    assert r["rounds"] >= 2 and all(len(v) == r["rounds"] for v in r["seconds"].values())
    assert r["save_ratio_vs_orbax"] > 0 and r["restore_ratio_vs_orbax"] > 0
    assert r["storage"].startswith("fake-gcs-server on 127.0.0.1")


BENCHMARKS = {
    "create": check_create,
    "recovery": check_recovery,
    "snapshot": check_snapshot,
    "gpu": check_gpu,
    "resize_hosts": check_resize_hosts,
    "suggest": check_suggest,
    "load": check_load,
    "tpu": check_tpu,
    "infer": check_infer,
    "init": check_init,
    "reshard": check_reshard,
    "resize": check_resize,
    "step": check_step,
    "guard": check_guard,
    "idioms": check_idioms,
    "restore": check_restore,
    "bucket": check_bucket,
    "vit": check_vit,
}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_benchmark_smoke(name, tmp_path):
    if name == "tpu":
        pytest.importorskip("libtpu", reason="libtpu is not installed (pip install 'nnx-shard[tpu]')")
    if name == "create":
        pytest.importorskip("tunix", reason="google-tunix is not installed (pip install 'nnx-shard[hf]')")
    out_file = tmp_path / f"{name}.json"
    run(f"bench_{name}.py", "--smoke", "--out", str(out_file), cwd=ROOT / "benchmarks")
    BENCHMARKS[name](json.loads(out_file.read_text()))


def test_reshard_repeat_reports_medians_of_its_runs(tmp_path):
    # the measure RESULTS.md records: the median of N alternating runs, for the warm round trips' median and
    # for the first warm round trip alone, each against the host round trip of the same run.
    out_file = tmp_path / "repeat.json"
    run("bench_reshard.py", "--smoke", "--repeat", "2", "--out", str(out_file), cwd=ROOT / "benchmarks")
    result = json.loads(out_file.read_text())
    assert len(result["runs"]) == 2
    for key in ("warm", "first_warm"):
        ratios = [r[f"{key}_s"] / r[f"host_{key}_s"] for r in result["runs"]]
        assert result[f"median_{key}_time_vs_host_round_trip"] == pytest.approx(
            statistics.median(ratios),
            rel=0.25,  # the times in the JSON are rounded to 1 ms
        )
        assert 0 < result[f"median_{key}_share_of_memcpy"] < 1
